//! Configuration files of the node's components, as text.

use std::path::Path;

use super::PAUSE_IMAGE;
use super::network::{BRIDGE, CLUSTER_CIDR, DNS_SERVICE_IP, Slot};

/// containerd 1.6 (config version 2) with all of its state under the node directory, the CRI
/// plugin on the cgroupfs driver and our own sandbox image.
pub(super) fn containerd(dir: &Path) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{d}/containerd/containerd.sock"

[ttrpc]
  address = "{d}/containerd/containerd.sock.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # The machines this runs on lack CAP_SYS_RESOURCE: a negative oom_score_adj cannot be set.
  restrict_oom_score_adj = true
  enable_selinux = false

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d}/runc"

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{d}/cni"
"#
    )
}

/// One bridge network for the node's Pods; no masquerade, since nothing outside is reachable.
pub(super) fn cni(dir: &Path, slot: Slot) -> String {
    let d = dir.display();
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "kube-netkit",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{ "subnet": slot.pod_cidr() }]],
                    "routes": [{ "dst": "0.0.0.0/0" }],
                    "dataDir": format!("{d}/cni-ipam"),
                },
            },
            { "type": "portmap", "capabilities": { "portMappings": true } },
        ],
    })
    .to_string()
}

/// The kubelet: cgroupfs on the host's cgroup v1, Pods under their own cgroup root, webhook
/// authentication and authorization of the API server's calls, cluster DNS.
pub(super) fn kubelet(dir: &Path, client_ca: &Path, slot: Slot) -> String {
    let d = dir.display();
    let ca = client_ca.display();
    let node_ip = slot.node_ip();
    let cgroup_root = slot.cgroup_root();
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: "{node_ip}"
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup_root}
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://{d}/containerd/containerd.sock
clusterDomain: cluster.local
clusterDNS: ["{DNS_SERVICE_IP}"]
resolvConf: ""
staticPodPath: ""
podLogsDir: {d}/pod-logs
tlsCertFile: {d}/kubelet.crt
tlsPrivateKeyFile: {d}/kubelet.key
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {ca}
authorization:
  mode: Webhook
syncFrequency: 10s
nodeStatusUpdateFrequency: 5s
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  nodefs.inodesFree: 1%
  imagefs.available: 1%
"#
    )
}

/// kube-proxy in iptables mode, leaving the node's conntrack sysctls as they are.
pub(super) fn kube_proxy(kubeconfig: &Path, slot: Slot) -> String {
    let k = kubeconfig.display();
    let name = slot.name();
    format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: {k}
hostnameOverride: {name}
mode: iptables
clusterCIDR: {CLUSTER_CIDR}
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack:
  maxPerCore: 0
  min: 0
iptables:
  minSyncPeriod: 0s
  syncPeriod: 30s
"#
    )
}
