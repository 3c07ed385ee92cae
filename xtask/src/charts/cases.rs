//! `cargo xtask charts`' table: the values each chart is rendered with, the values Pod Security
//! must refuse, the values that must not render (with the chart's message) and the kustomize trees.

/// A chart rendered with some values.
pub(super) struct Case {
    pub(super) chart: &'static str,
    pub(super) namespace: &'static str,
    pub(super) what: &'static str,
    pub(super) sets: &'static [&'static str],
}

pub(super) const STEWARD_UPSTREAM: &str = "upstreamAddr=api.tenant.example:6443";
pub(super) const DIGEST: &str =
    "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// Namespaces labelled `pod-security.kubernetes.io/enforce=restricted` in the dry run: each
/// Deployment rendered into one is also dry-run as a Pod of its template, which Pod Security
/// admission judges (it only warns on a Deployment).
pub(super) const RESTRICTED: [&str; 3] = [
    "steward-restricted",
    "infra-restricted",
    "rstream-restricted",
];

/// Values whose Pods Pod Security `restricted` must refuse, with a word of its message.
pub(super) const REFUSED_BY_POD_SECURITY: &[(&str, &[&str], &str, &str)] = &[(
    "pod-proxier",
    &["hostNetwork=true"],
    "infra-restricted",
    "host namespaces",
)];

pub(super) const CASES: &[Case] = &[
    Case {
        chart: "steward-tcp-proxy",
        namespace: "kube-system",
        what: "defaults",
        sets: &[STEWARD_UPSTREAM],
    },
    Case {
        chart: "steward-tcp-proxy",
        namespace: "steward-restricted",
        what: "defaults under Pod Security restricted",
        sets: &[STEWARD_UPSTREAM],
    },
    Case {
        chart: "steward-tcp-proxy",
        namespace: "kube-system",
        what: "the common values: digest, pull secrets, priority class, scheduling, resources, longer drain",
        sets: &[
            STEWARD_UPSTREAM,
            "string:image.digest=DIGEST",
            "imagePullSecrets[0].name=regcred",
            "priorityClassName=system-cluster-critical",
            "nodeSelector.disk=ssd",
            "tolerations[0].key=dedicated,tolerations[0].operator=Exists",
            "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight=1",
            "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference.matchExpressions[0].key=zone",
            "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference.matchExpressions[0].operator=Exists",
            "podAnnotations.team=net",
            "resources.limits.memory=256Mi",
            "shutdownDelay=1.5s,drainTimeout=2m",
        ],
    },
    Case {
        chart: "steward-tcp-proxy",
        namespace: "kube-system",
        what: "cluster-ip mode, no leader election, one thread, tokio data path",
        sets: &[
            STEWARD_UPSTREAM,
            "endpointMode=cluster-ip",
            "leaderElection.enabled=false",
            "replicaCount=1",
            "threads=1",
            "dataPath=tokio",
        ],
    },
    Case {
        chart: "steward-tcp-proxy",
        namespace: "kube-system",
        what: "TLS termination on host network",
        sets: &[
            STEWARD_UPSTREAM,
            "tls.enabled=true",
            "tls.secretName=apiserver-tls",
            "tls.upstreamCAConfigMap=kube-root-ca.crt",
            "hostNetwork=true",
        ],
    },
    Case {
        chart: "steward-tcp-proxy",
        namespace: "kube-system",
        what: "upstream through an HTTP proxy (URL from a Secret)",
        sets: &[STEWARD_UPSTREAM, "upstreamProxySecret=egress-proxy"],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "defaults",
        sets: &[],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra-restricted",
        what: "defaults under Pod Security restricted",
        sets: &[],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "hostNetwork (Pod Security privileged), no Service",
        sets: &["hostNetwork=true", "service.enabled=false"],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "the common values: digest, pull secrets, priority class, scheduling, NodePort",
        sets: &[
            "string:image.digest=DIGEST",
            "imagePullSecrets[0].name=regcred",
            "priorityClassName=high",
            "nodeSelector.disk=ssd",
            "tolerations[0].key=dedicated,tolerations[0].operator=Exists",
            "affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight=1",
            "affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].podAffinityTerm.topologyKey=kubernetes.io/hostname",
            "podAnnotations.team=net",
            "service.type=NodePort",
        ],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "V1 only",
        sets: &["podProxier.enableV1=true", "podProxier.enableV2=false"],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "V2 only",
        sets: &[
            "podProxier.enableV1=false",
            "podProxier.enableV2=true",
            "podProxier.allowedNamespaces={default,team-a}",
        ],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "AWS load balancer",
        sets: &[
            "service.enabled=true",
            "service.type=LoadBalancer",
            "service.cloudProvider=aws",
        ],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "GCP load balancer with extra annotations",
        sets: &[
            "service.enabled=true",
            "service.type=LoadBalancer",
            "service.cloudProvider=gcp",
            "service.annotations.team=net",
        ],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "HAProxy backend",
        sets: &["podProxier.backend=haproxy"],
    },
    Case {
        chart: "rstream-operator",
        namespace: "rstream-system",
        what: "defaults",
        sets: &[],
    },
    Case {
        chart: "rstream-operator",
        namespace: "rstream-restricted",
        what: "defaults under Pod Security restricted",
        sets: &[],
    },
    Case {
        chart: "rstream-operator",
        namespace: "rstream-system",
        what: "moved ports, one watched namespace, pull secrets, digests, priority class",
        sets: &[
            "metrics.bindAddress=0.0.0.0:9000",
            "health.bindAddress=:9001",
            "watchNamespace=team-a",
            "imagePullSecrets[0].name=regcred",
            "string:image.digest=DIGEST",
            "agent.image.repository=registry.example/agent",
            "string:agent.image.digest=DIGEST",
            "priorityClassName=high",
        ],
    },
    Case {
        chart: "rstream-operator",
        namespace: "rstream-system",
        what: "metrics endpoint off",
        sets: &["string:metrics.bindAddress=0"],
    },
    Case {
        chart: "rstream-operator",
        namespace: "rstream-system",
        what: "without CRDs",
        sets: &["crds.install=false"],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "without CRDs, or with CRDs that uninstall removes",
        sets: &["crds.install=false", "crds.keep=false"],
    },
    Case {
        chart: "rstream-operator",
        namespace: "rstream-system",
        what: "leader election off",
        sets: &["leaderElection.enabled=false"],
    },
];

/// Values that must not render, with the message the chart gives.
pub(super) const WRONG: &[(&str, &[&str], &str)] = &[
    (
        "pod-proxier",
        &[
            "service.enabled=true",
            "service.type=LoadBalancer",
            "service.cloudProvider=azure",
        ],
        "cloudProvider",
    ),
    (
        "pod-proxier",
        &[
            "podProxier.portRangeStart=9100",
            "podProxier.portRangeEnd=9000",
        ],
        "must be lower than",
    ),
    (
        "pod-proxier",
        &["podProxier.enableV1=false", "podProxier.enableV2=false"],
        "enable at least one",
    ),
    ("steward-tcp-proxy", &[], "upstreamAddr"),
    (
        "steward-tcp-proxy",
        &[STEWARD_UPSTREAM, "endpointMode=node-ip"],
        "endpointMode",
    ),
    (
        "steward-tcp-proxy",
        &[STEWARD_UPSTREAM, "tls.enabled=true"],
        "tls.secretName",
    ),
    (
        "steward-tcp-proxy",
        &[STEWARD_UPSTREAM, "threads=0"],
        "threads",
    ),
    (
        "steward-tcp-proxy",
        &[STEWARD_UPSTREAM, "threads=1025"],
        "threads",
    ),
    (
        "steward-tcp-proxy",
        &[STEWARD_UPSTREAM, "dataPath=epoll"],
        "dataPath",
    ),
    ("pod-proxier", &["podProxier.dataPath=uring"], "dataPath"),
    ("rstream-operator", &["logFormat=xml"], "logFormat"),
    (
        "rstream-operator",
        &["loadBalancerClass=rstream"],
        "loadBalancerClass",
    ),
    // Unknown keys: a typo, and the values of before.
    (
        "rstream-operator",
        &["installCRDs=true"],
        "additional properties 'installCRDs' not allowed",
    ),
    (
        "pod-proxier",
        &["images.podProxier.tag=0.1.0"],
        "additional properties 'images' not allowed",
    ),
    (
        "steward-tcp-proxy",
        &[STEWARD_UPSTREAM, "image.digets=sha256:00"],
        "additional properties 'digets' not allowed",
    ),
    (
        "rstream-operator",
        &[
            "string:metrics.bindAddress=0",
            "serviceMonitor.enabled=true",
        ],
        "serviceMonitor.enabled needs the metrics endpoint",
    ),
    (
        "steward-tcp-proxy",
        &[
            STEWARD_UPSTREAM,
            "metricsPort=0",
            "serviceMonitor.enabled=true",
        ],
        "serviceMonitor.enabled needs the metrics endpoint",
    ),
    (
        "steward-tcp-proxy",
        &[STEWARD_UPSTREAM, "opsBindFailure=ignore"],
        "opsBindFailure",
    ),
];

/// kustomize trees and the namespace their unnamespaced objects land in.
pub(super) const KUSTOMIZE: &[(&str, &str)] = &[
    ("pod-proxier/config", "infra"),
    ("rstream-operator/config/default", "rstream-system"),
    ("steward-tcp-proxy/config", "kube-system"),
];
