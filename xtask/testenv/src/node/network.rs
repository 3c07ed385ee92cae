//! The node's network: its own network namespace, joined to the host by one veth pair, with routes
//! and guard rules that keep every Pod and Service packet on this machine.
//!
//! ```text
//!  host netns                                 node netns (kubelet, containerd, kube-proxy)
//!  kube-apiserver 10.243.0.1 ── knk-h ═══ knk-n ── 10.243.0.2 (node IP)
//!  routes: 10.244.0.0/24, 10.96.0.0/16            bridge knk0 10.244.0.1 ── Pod veths
//!          via 10.243.0.2; blackholes under them  ip_forward=1 here only
//! ```
//!
//! Everything kubelet and kube-proxy program (iptables chains, the bridge, conntrack, forwarding)
//! lives in the node's namespace and disappears with it. On the host the node adds only the veth,
//! two routes, two blackhole routes and one nftables table, all removed by the teardown script,
//! which the guardian also runs when the test binary dies.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::super::TestingError;
use super::super::process::Guardian;

/// The node's network namespace (one test node per machine at a time): `ip netns exec` it to see
/// what kubelet, kube-proxy and the CNI plugins made.
pub const NETNS: &str = "knk-node";
/// The host's end of the link to the node.
const HOST_LINK: &str = "knk-h";
/// The node's end of the link.
const NODE_LINK: &str = "knk-n";
/// The host's address on the link: where Pods reach the API server.
pub const HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 243, 0, 1);
/// The node's address (its `InternalIP`): NodePorts and the kubelet listen here.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 243, 0, 2);
const LINK_CIDR: &str = "10.243.0.0/30";
/// Pod addresses of the whole cluster (kube-proxy's `clusterCIDR`).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The node's Pod subnet, handed out by the CNI bridge.
pub const POD_CIDR: &str = "10.244.0.0/24";
/// Pod gateway: the bridge's address.
const POD_GATEWAY: &str = "10.244.0.1";
/// ClusterIPs (the API server's `--service-cluster-ip-range`).
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// Blackholed on the host under the Service route, so a ClusterIP never follows the default route.
const SERVICE_GUARD_CIDR: &str = "10.96.0.0/12";
/// The `kubernetes` Service's ClusterIP (the first address of the range).
pub const KUBERNETES_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);
/// The `kube-dns` Service's ClusterIP.
pub const DNS_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The CNI bridge in the node's namespace.
pub(super) const BRIDGE: &str = "knk0";
/// The cgroup (in every v1 hierarchy) under which kubelet puts Pods.
pub(super) const CGROUP_ROOT: &str = "kube-netkit-node";
const HOST_TABLE: &str = "kube_netkit_node";
/// Directories containerd and `ip netns` create on first use, deepest first; teardown removes
/// those that did not exist before the node (when empty).
const RUNTIME_DIRS: [&str; 7] = [
    "/run/containerd/s",
    "/run/containerd/fifo",
    "/run/containerd/runc/k8s.io",
    "/run/containerd/runc",
    "/run/containerd",
    "/run/netns",
    "/var/log/containers",
];

/// The node's network and its teardown; dropping it tears everything down.
pub(crate) struct NodeNetwork {
    pub(super) dir: PathBuf,
    // Holds the machine lock from before the node exists until its teardown has run.
    guardian: Guardian,
}

/// The machine-wide lock of the one test node, held by the node's guardian (`flock`).
pub const MACHINE_LOCK: &str = "/run/lock/kube-netkit-node.lock";
/// How long a node waits for another one (e.g. of a concurrent test run) to stop.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(20 * 60);

impl NodeNetwork {
    /// Creates the node directory, the teardown script and its guardian, then the namespace, link,
    /// routes and guard rules. On error everything made so far is removed.
    pub(crate) fn create() -> Result<Self, TestingError> {
        let dir = tempfile::Builder::new()
            .prefix("kube-netkit-node-")
            .tempdir()
            .map_err(|source| io("creating the node directory", source))?
            .keep();
        let script = dir.join("teardown.sh");
        if let Some(parent) = Path::new(MACHINE_LOCK).parent() {
            std::fs::create_dir_all(parent)
                .map_err(|source| io(&format!("creating {}", parent.display()), source))?;
        }
        let guardian = match Guardian::teardown(&script, Path::new(MACHINE_LOCK), LOCK_WAIT) {
            Ok(guardian) => guardian,
            Err(err) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(err);
            }
        };
        write(&script, &teardown_script(&dir))?;
        let netns_path = netns_path();
        if netns_path.exists() {
            return Err(TestingError::NodeUnavailable(format!(
                "{} exists, left by something other than a test node; remove it (ip netns del {NETNS})",
                netns_path.display()
            )));
        }
        // What exists before the node, so that teardown removes only what the node added.
        write(&dir.join("netns-before"), &list_dir("/run/netns"))?;
        write(&dir.join("shims-before"), &list_dir("/run/containerd/s"))?;
        let existing: String = RUNTIME_DIRS
            .iter()
            .filter(|d| Path::new(d).exists())
            .map(|d| format!("{d}\n"))
            .collect();
        write(&dir.join("dirs-before"), &existing)?;
        let network = Self { dir, guardian };
        network.set_up()?;
        Ok(network)
    }

    fn set_up(&self) -> Result<(), TestingError> {
        let host_cidr = format!("{HOST_IP}/30");
        let node_cidr = format!("{NODE_IP}/30");
        let node_ip = NODE_IP.to_string();
        run("ip", &["netns", "add", NETNS])?;
        run(
            "ip",
            &[
                "link", "add", HOST_LINK, "type", "veth", "peer", "name", NODE_LINK, "netns", NETNS,
            ],
        )?;
        run("ip", &["addr", "add", &host_cidr, "dev", HOST_LINK])?;
        run("ip", &["link", "set", HOST_LINK, "up"])?;
        run("ip", &["-n", NETNS, "link", "set", "lo", "up"])?;
        run(
            "ip",
            &["-n", NETNS, "addr", "add", &node_cidr, "dev", NODE_LINK],
        )?;
        run("ip", &["-n", NETNS, "link", "set", NODE_LINK, "up"])?;
        // The bridge exists before the first Pod so the node's addresses are known from the start.
        run(
            "ip",
            &["-n", NETNS, "link", "add", BRIDGE, "type", "bridge"],
        )?;
        run(
            "ip",
            &[
                "-n",
                NETNS,
                "addr",
                "add",
                &format!("{POD_GATEWAY}/24"),
                "dev",
                BRIDGE,
            ],
        )?;
        run("ip", &["-n", NETNS, "link", "set", BRIDGE, "up"])?;

        // Host side: guard first, then the blackholes, then the specific routes to the node.
        let guard = self.dir.join("host-guard.nft");
        write(&guard, &host_guard_rules())?;
        run("nft", &["-f", &guard.to_string_lossy()])?;
        run("ip", &["route", "add", "blackhole", CLUSTER_CIDR])?;
        run("ip", &["route", "add", "blackhole", SERVICE_GUARD_CIDR])?;
        run("ip", &["route", "add", POD_CIDR, "via", &node_ip])?;
        run("ip", &["route", "add", SERVICE_CIDR, "via", &node_ip])?;

        // Node side: its guard, then forwarding (Pod -> ClusterIP -> Pod and Pod -> API server).
        let node_guard = self.dir.join("node-guard.nft");
        write(&node_guard, &node_guard_rules())?;
        in_node("nft", &["-f", &node_guard.to_string_lossy()])?;
        in_node("sysctl", &["-qw", "net.ipv4.ip_forward=1"])?;
        in_node("sysctl", &["-qw", "net.bridge.bridge-nf-call-iptables=1"])?;
        Ok(())
    }

    /// Runs the teardown now and waits for it.
    pub(super) fn tear_down(&mut self) {
        self.guardian.release();
    }
}

impl Drop for NodeNetwork {
    fn drop(&mut self) {
        self.tear_down();
    }
}

/// The path of the node's network namespace, for `nsenter --net=`.
pub(super) fn netns_path() -> PathBuf {
    Path::new("/run/netns").join(NETNS)
}

/// Drops, on the host, any packet to or from the node's ranges that would leave through an
/// interface other than the node link (or loopback, for the API server's own address).
fn host_guard_rules() -> String {
    let ranges = format!("{CLUSTER_CIDR}, {SERVICE_GUARD_CIDR}, {LINK_CIDR}");
    format!(
        r#"table inet {HOST_TABLE} {{
    chain output {{
        type filter hook output priority -10; policy accept;
        ip daddr {{ {ranges} }} oifname != {{ "{HOST_LINK}", "lo" }} drop
    }}
    chain forward {{
        type filter hook forward priority -10; policy accept;
        ip saddr {{ {ranges} }} oifname != "{HOST_LINK}" drop
        ip daddr {{ {ranges} }} oifname != "{HOST_LINK}" drop
    }}
}}
"#
    )
}

/// Inside the node: forward only between the node's own ranges; IPv6 is not forwarded at all.
fn node_guard_rules() -> String {
    let ranges = format!("{CLUSTER_CIDR}, {SERVICE_GUARD_CIDR}, {LINK_CIDR}");
    format!(
        r#"table inet kube_netkit_guard {{
    chain forward {{
        type filter hook forward priority -10; policy accept;
        meta nfproto ipv6 drop
        ip daddr != {{ {ranges} }} drop
        ip saddr != {{ {ranges} }} drop
    }}
}}
"#
    )
}

/// The nftables table that cuts the node off from the API server; the node's namespace takes it
/// with it at teardown.
const PARTITION_TABLE: &str = "kube_netkit_partition";

/// Inside the node: drop, silently as a broken link does, every packet between the node (kubelet,
/// kube-proxy, and Pods reaching the `kubernetes` Service, forwarded after kube-proxy's DNAT) and
/// the API server's port on the host. Everything else on the link (the host reaching NodePorts,
/// ClusterIPs and Pods) still flows.
fn partition_rules(apiserver_port: u16) -> String {
    let to = format!("ip daddr {HOST_IP} tcp dport {apiserver_port} drop");
    let from = format!("ip saddr {HOST_IP} tcp sport {apiserver_port} drop");
    format!(
        r#"table inet {PARTITION_TABLE} {{
    chain output {{
        type filter hook output priority -20; policy accept;
        {to}
    }}
    chain input {{
        type filter hook input priority -20; policy accept;
        {from}
    }}
    chain forward {{
        type filter hook forward priority -20; policy accept;
        {to}
        {from}
    }}
}}
"#
    )
}

/// Cuts the node's link to the API server listening on `apiserver_port` (see
/// [`partition_rules`]); the rules are written to `dir` first.
pub(super) fn cut_apiserver_link(dir: &Path, apiserver_port: u16) -> Result<(), TestingError> {
    let rules = dir.join("partition.nft");
    write(&rules, &partition_rules(apiserver_port))?;
    in_node("nft", &["-f", &rules.display().to_string()])
}

/// Removes the cut of [`cut_apiserver_link`].
pub(super) fn restore_apiserver_link() -> Result<(), TestingError> {
    in_node("nft", &["delete", "table", "inet", PARTITION_TABLE])
}

/// The one teardown of a node, idempotent; run by `Drop` and, if the test binary dies first, by
/// the guardian. Order: processes (ours, then every shim and container of our containerd), mounts
/// under the node directory, Pod network namespaces it added, the node namespace (taking its
/// iptables, bridge and veths with it), host routes and guard table, cgroups, files.
fn teardown_script(dir: &Path) -> String {
    let dir = dir.display();
    let runtime_dirs = RUNTIME_DIRS.join(" ");
    format!(
        r#"dir='{dir}'
sock="$dir/containerd/containerd.sock"
self=$$
[ -f "$dir/pids" ] && kill -KILL $(cat "$dir/pids") 2>/dev/null
for round in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
  found=
  for p in /proc/[0-9]*; do
    pid=${{p#/proc/}}
    [ "$pid" = "$self" ] && continue
    if tr '\0' ' ' < "$p/cmdline" 2>/dev/null | grep -qF -- "$sock"; then
      kill -KILL "$pid" 2>/dev/null && found=1
    fi
  done
  for procs in /sys/fs/cgroup/*/{CGROUP_ROOT}/cgroup.procs /sys/fs/cgroup/*/{CGROUP_ROOT}/*/cgroup.procs /sys/fs/cgroup/*/{CGROUP_ROOT}/*/*/cgroup.procs /sys/fs/cgroup/*/{CGROUP_ROOT}/*/*/*/cgroup.procs /sys/fs/cgroup/*/{CGROUP_ROOT}/*/*/*/*/cgroup.procs; do
    [ -f "$procs" ] || continue
    for pid in $(cat "$procs" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null && found=1; done
  done
  [ -z "$found" ] && break
  sleep 0.2
done
awk -v d="$dir/" 'index($5, d) == 1 {{ print $5 }}' /proc/self/mountinfo | sort -r | while read -r m; do
  umount -l "$m" 2>/dev/null
done
for ns in $(ls /run/netns 2>/dev/null); do
  case "$ns" in cni-*) ;; *) continue ;; esac
  grep -qx -- "$ns" "$dir/netns-before" 2>/dev/null && continue
  umount -l "/run/netns/$ns" 2>/dev/null; rm -f "/run/netns/$ns"
done
for s in $(ls /run/containerd/s 2>/dev/null); do
  grep -qx -- "$s" "$dir/shims-before" 2>/dev/null || rm -f "/run/containerd/s/$s"
done
ip netns del {NETNS} 2>/dev/null
ip link del {HOST_LINK} 2>/dev/null
ip route del {POD_CIDR} via {NODE_IP} 2>/dev/null
ip route del {SERVICE_CIDR} via {NODE_IP} 2>/dev/null
ip route del blackhole {CLUSTER_CIDR} 2>/dev/null
ip route del blackhole {SERVICE_GUARD_CIDR} 2>/dev/null
nft delete table inet {HOST_TABLE} 2>/dev/null
for c in /sys/fs/cgroup/*/{CGROUP_ROOT}; do
  [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {{}} \; 2>/dev/null
done
find /var/log/containers -maxdepth 1 -lname "$dir/*" -delete 2>/dev/null
for d in {runtime_dirs}; do
  grep -qx -- "$d" "$dir/dirs-before" 2>/dev/null && continue
  [ -d "$d" ] && [ -z "$(ls -A "$d")" ] || continue
  # `ip netns` bind-mounts /run/netns onto itself.
  [ "$d" = /run/netns ] && umount "$d" 2>/dev/null
  rmdir "$d" 2>/dev/null
done
rm -rf --one-file-system "$dir"
exit 0
"#
    )
}

fn list_dir(path: &str) -> String {
    std::fs::read_dir(path)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| format!("{}\n", e.file_name().to_string_lossy()))
                .collect()
        })
        .unwrap_or_default()
}

/// Runs a command in the node's network namespace (only its network: the mount namespace stays
/// the host's, which kubelet and containerd must share).
pub(super) fn in_node(program: &str, args: &[&str]) -> Result<(), TestingError> {
    let netns = format!("--net={}", netns_path().display());
    let mut all = vec![netns.as_str(), "--", program];
    all.extend_from_slice(args);
    run("nsenter", &all)
}

/// Runs a set-up command; a failure names the command and its output.
pub(super) fn run(program: &str, args: &[&str]) -> Result<(), TestingError> {
    let output = Command::new(program)
        .args(args)
        .output()
        .map_err(|source| io(&format!("running {program}"), source))?;
    if output.status.success() {
        return Ok(());
    }
    Err(TestingError::NodeUnavailable(format!(
        "`{program} {}` failed ({}): {}",
        args.join(" "),
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    )))
}

pub(super) fn write(path: &Path, contents: &str) -> Result<(), TestingError> {
    std::fs::write(path, contents)
        .map_err(|source| io(&format!("writing {}", path.display()), source))
}

pub(super) fn io(context: &str, source: std::io::Error) -> TestingError {
    TestingError::Io {
        context: context.to_owned(),
        cause: source,
    }
}
