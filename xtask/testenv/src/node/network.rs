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
//!
//! A second node (see [`Slot`]) gets the same layout with the next addresses: namespace
//! `knk-node-2`, link `knk-h2` ═══ `knk-n2` (10.243.0.5 ── 10.243.0.6), Pods in 10.244.1.0/24.
//! Between nodes the host routes: each node namespace sends the other nodes' Pod subnets and links
//! to its host end, and the host forwards between node links only (forwarding is switched on for
//! those links alone, never machine-wide, and the host guard drops anything forwarded from a node
//! link to any other interface). The blackholes under the routes stay, so a lost node's subnet
//! (its link down, its route gone) is dropped on the host instead of following the default route.

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
/// Every node link of a cluster of several nodes (one /30 each).
const LINKS_CIDR: &str = "10.243.0.0/24";
/// How many nodes a test cluster may have (the link and Pod addresses of each are fixed).
pub const MAX_NODES: usize = 4;
/// Pod addresses of the whole cluster (kube-proxy's `clusterCIDR`).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The node's Pod subnet, handed out by the CNI bridge.
pub const POD_CIDR: &str = "10.244.0.0/24";
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

/// Where node `index` (0-based) of a test cluster sits on the machine: its name, namespace,
/// link, addresses, Pod subnet and cgroup. The first node's are the constants of this module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Slot {
    pub(super) index: usize,
}

impl Slot {
    /// `""` for the first node, `-2`, `-3`, ... for the others.
    fn suffix(self, separator: &str) -> String {
        if self.index == 0 {
            String::new()
        } else {
            format!("{separator}{}", self.index + 1)
        }
    }

    pub(super) fn name(self) -> String {
        format!("{}{}", super::NODE_NAME, self.suffix("-"))
    }

    pub(super) fn netns(self) -> String {
        format!("{NETNS}{}", self.suffix("-"))
    }

    pub(super) fn netns_path(self) -> PathBuf {
        Path::new("/run/netns").join(self.netns())
    }

    pub(super) fn host_link(self) -> String {
        format!("{HOST_LINK}{}", self.suffix(""))
    }

    fn node_link(self) -> String {
        format!("{NODE_LINK}{}", self.suffix(""))
    }

    // The index is at most MAX_NODES - 1, so the octets below never overflow.
    fn octet(self, offset: usize) -> u8 {
        u8::try_from(self.index * 4 + offset).unwrap_or(u8::MAX)
    }

    /// The host's address on this node's link (the first node's is [`HOST_IP`]).
    pub(super) fn host_ip(self) -> Ipv4Addr {
        Ipv4Addr::new(10, 243, 0, self.octet(1))
    }

    /// The node's `InternalIP` (the first node's is [`NODE_IP`]).
    pub(super) fn node_ip(self) -> Ipv4Addr {
        Ipv4Addr::new(10, 243, 0, self.octet(2))
    }

    /// The node's Pod subnet (the first node's is [`POD_CIDR`]).
    pub(super) fn pod_cidr(self) -> String {
        format!("10.244.{}.0/24", self.index)
    }

    fn pod_gateway(self) -> String {
        format!("10.244.{}.1", self.index)
    }

    /// The cgroup (in every v1 hierarchy) under which this node's kubelet puts Pods.
    pub(super) fn cgroup_root(self) -> String {
        format!("{CGROUP_ROOT}{}", self.suffix("-"))
    }

    /// The node's own directory under the cluster's node directory.
    pub(super) fn dir(self, cluster_dir: &Path) -> PathBuf {
        if self.index == 0 {
            cluster_dir.to_owned()
        } else {
            cluster_dir.join(format!("node{}", self.suffix("-")))
        }
    }

    /// containerd's socket: also how the teardown finds this node's shims.
    pub(super) fn containerd_socket(self, cluster_dir: &Path) -> PathBuf {
        self.dir(cluster_dir)
            .join("containerd")
            .join("containerd.sock")
    }
}

/// The network of every node of a test cluster and its teardown; dropping it tears everything
/// down.
pub(crate) struct NodeNetwork {
    pub(crate) dir: PathBuf,
    pub(super) slots: Vec<Slot>,
    // Holds the machine lock from before the node exists until its teardown has run.
    guardian: Guardian,
}

/// The machine-wide lock of the one test node, held by the node's guardian (`flock`).
pub const MACHINE_LOCK: &str = "/run/lock/kube-netkit-node.lock";
/// How long a node waits for another one (e.g. of a concurrent test run) to stop.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(20 * 60);

impl NodeNetwork {
    /// Creates the node directory, the teardown script and its guardian, then for each of `nodes`
    /// nodes the namespace, link, routes and guard rules. On error everything made so far is
    /// removed.
    pub(crate) fn create(nodes: usize) -> Result<Self, TestingError> {
        if nodes == 0 || nodes > MAX_NODES {
            return Err(TestingError::Config(format!(
                "a test cluster has 1 to {MAX_NODES} nodes, not {nodes}"
            )));
        }
        let slots: Vec<Slot> = (0..nodes).map(|index| Slot { index }).collect();
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
        write(&script, &teardown_script(&dir, &slots))?;
        for slot in &slots {
            let netns_path = slot.netns_path();
            if netns_path.exists() {
                return Err(TestingError::NodeUnavailable(format!(
                    "{} exists, left by something other than a test node; remove it (ip netns del {})",
                    netns_path.display(),
                    slot.netns()
                )));
            }
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
        let network = Self {
            dir,
            slots,
            guardian,
        };
        network.set_up()?;
        Ok(network)
    }

    fn set_up(&self) -> Result<(), TestingError> {
        let several = self.slots.len() > 1;
        // Host side: guard first, then the blackholes, then the links and routes of each node.
        let guard = self.dir.join("host-guard.nft");
        write(&guard, &host_guard_rules(&self.slots))?;
        run("nft", &["-f", &guard.to_string_lossy()])?;
        run("ip", &["route", "add", "blackhole", CLUSTER_CIDR])?;
        run("ip", &["route", "add", "blackhole", SERVICE_GUARD_CIDR])?;
        let node_guard = self.dir.join("node-guard.nft");
        write(&node_guard, &node_guard_rules(several))?;
        for &slot in &self.slots {
            set_up_node(slot, several, &node_guard)?;
        }
        // The host sends ClusterIPs to the first node, whose kube-proxy routes them.
        run(
            "ip",
            &["route", "add", SERVICE_CIDR, "via", &NODE_IP.to_string()],
        )?;
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

/// One node's namespace, link, bridge, host route and (in a cluster of several) the routes to
/// the other nodes through the host.
fn set_up_node(slot: Slot, several: bool, node_guard: &Path) -> Result<(), TestingError> {
    let netns = slot.netns();
    let netns = netns.as_str();
    let (host_link, node_link) = (slot.host_link(), slot.node_link());
    let host_cidr = format!("{}/30", slot.host_ip());
    let node_cidr = format!("{}/30", slot.node_ip());
    let host_ip = slot.host_ip().to_string();
    let node_ip = slot.node_ip().to_string();
    run("ip", &["netns", "add", netns])?;
    run(
        "ip",
        &[
            "link", "add", &host_link, "type", "veth", "peer", "name", &node_link, "netns", netns,
        ],
    )?;
    run("ip", &["addr", "add", &host_cidr, "dev", &host_link])?;
    run("ip", &["link", "set", &host_link, "up"])?;
    run("ip", &["-n", netns, "link", "set", "lo", "up"])?;
    run(
        "ip",
        &["-n", netns, "addr", "add", &node_cidr, "dev", &node_link],
    )?;
    run("ip", &["-n", netns, "link", "set", &node_link, "up"])?;
    // The bridge exists before the first Pod so the node's addresses are known from the start.
    run(
        "ip",
        &["-n", netns, "link", "add", BRIDGE, "type", "bridge"],
    )?;
    run(
        "ip",
        &[
            "-n",
            netns,
            "addr",
            "add",
            &format!("{}/24", slot.pod_gateway()),
            "dev",
            BRIDGE,
        ],
    )?;
    run("ip", &["-n", netns, "link", "set", BRIDGE, "up"])?;
    run("ip", &["route", "add", &slot.pod_cidr(), "via", &node_ip])?;
    if several {
        // Other nodes' Pods and links (and the API server on the first link) through the host;
        // the node's own bridge and link routes are more specific and win.
        for range in [CLUSTER_CIDR, LINKS_CIDR] {
            run("ip", &["-n", netns, "route", "add", range, "via", &host_ip])?;
        }
        // The host forwards what arrives on node links, and only that (never machine-wide).
        let forwarding = format!("/proc/sys/net/ipv4/conf/{host_link}/forwarding");
        write(Path::new(&forwarding), "1")?;
    }

    // Node side: its guard, then forwarding (Pod -> ClusterIP -> Pod and Pod -> API server).
    in_netns(slot, "nft", &["-f", &node_guard.to_string_lossy()])?;
    in_netns(slot, "sysctl", &["-qw", "net.ipv4.ip_forward=1"])?;
    in_netns(
        slot,
        "sysctl",
        &["-qw", "net.bridge.bridge-nf-call-iptables=1"],
    )?;
    Ok(())
}

/// The node links' ranges: the one link's, or the block of all links.
fn link_ranges(several: bool) -> &'static str {
    if several { LINKS_CIDR } else { LINK_CIDR }
}

/// Drops, on the host, any packet to or from the nodes' ranges that would leave through an
/// interface other than a node link (or loopback, for the API server's own address), and
/// anything forwarded from a node link to another interface.
fn host_guard_rules(slots: &[Slot]) -> String {
    let ranges = format!(
        "{CLUSTER_CIDR}, {SERVICE_GUARD_CIDR}, {}",
        link_ranges(slots.len() > 1)
    );
    let links = slots
        .iter()
        .map(|s| format!("\"{}\"", s.host_link()))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        r#"table inet {HOST_TABLE} {{
    chain output {{
        type filter hook output priority -10; policy accept;
        ip daddr {{ {ranges} }} oifname != {{ {links}, "lo" }} drop
    }}
    chain forward {{
        type filter hook forward priority -10; policy accept;
        iifname {{ {links} }} oifname != {{ {links} }} drop
        ip saddr {{ {ranges} }} oifname != {{ {links} }} drop
        ip daddr {{ {ranges} }} oifname != {{ {links} }} drop
    }}
}}
"#
    )
}

/// Inside the node: forward only between the cluster's own ranges; IPv6 is not forwarded at all.
fn node_guard_rules(several: bool) -> String {
    let ranges = format!(
        "{CLUSTER_CIDR}, {SERVICE_GUARD_CIDR}, {}",
        link_ranges(several)
    );
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
pub(super) fn cut_apiserver_link(
    slot: Slot,
    dir: &Path,
    apiserver_port: u16,
) -> Result<(), TestingError> {
    let rules = dir.join("partition.nft");
    write(&rules, &partition_rules(apiserver_port))?;
    in_netns(slot, "nft", &["-f", &rules.display().to_string()])
}

/// Removes the cut of [`cut_apiserver_link`].
pub(super) fn restore_apiserver_link(slot: Slot) -> Result<(), TestingError> {
    in_netns(slot, "nft", &["delete", "table", "inet", PARTITION_TABLE])
}

/// Takes a lost node's link down on the host: nothing reaches its Pods or its address any more,
/// and its Pod route goes with the link, so its subnet falls onto the host's blackhole.
pub(super) fn cut_node_link(slot: Slot) -> Result<(), TestingError> {
    run("ip", &["link", "set", &slot.host_link(), "down"])
}

/// The one teardown of a node, idempotent; run by `Drop` and, if the test binary dies first, by
/// the guardian. Order: processes (ours, then every shim and container of our containerd), mounts
/// under the node directory, Pod network namespaces it added, the node namespace (taking its
/// iptables, bridge and veths with it), host routes and guard table, cgroups, files.
fn teardown_script(dir: &Path, slots: &[Slot]) -> String {
    let runtime_dirs = RUNTIME_DIRS.join(" ");
    let sockets = slots
        .iter()
        .map(|s| format!("'{}'", s.containerd_socket(dir).display()))
        .collect::<Vec<_>>()
        .join(" ");
    let cgroup_procs = slots
        .iter()
        .flat_map(|s| {
            let root = s.cgroup_root();
            (0..5).map(move |depth| {
                format!("/sys/fs/cgroup/*/{root}/{}cgroup.procs", "*/".repeat(depth))
            })
        })
        .collect::<Vec<_>>()
        .join(" ");
    let cgroup_roots = slots
        .iter()
        .map(|s| format!("/sys/fs/cgroup/*/{}", s.cgroup_root()))
        .collect::<Vec<_>>()
        .join(" ");
    let mut network = String::new();
    for slot in slots {
        network.push_str(&format!(
            "ip netns del {}\nip link del {}\nip route del {} via {}\n",
            slot.netns(),
            slot.host_link(),
            slot.pod_cidr(),
            slot.node_ip()
        ));
    }
    let network: String = network
        .lines()
        .map(|l| format!("{l} 2>/dev/null\n"))
        .collect();
    let dir = dir.display();
    format!(
        r#"dir='{dir}'
self=$$
[ -f "$dir/pids" ] && kill -KILL $(cat "$dir/pids") 2>/dev/null
for round in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
  found=
  for p in /proc/[0-9]*; do
    pid=${{p#/proc/}}
    [ "$pid" = "$self" ] && continue
    for sock in {sockets}; do
      if tr '\0' ' ' < "$p/cmdline" 2>/dev/null | grep -qF -- "$sock"; then
        kill -KILL "$pid" 2>/dev/null && found=1
      fi
    done
  done
  for procs in {cgroup_procs}; do
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
{network}ip route del {SERVICE_CIDR} via {NODE_IP} 2>/dev/null
ip route del blackhole {CLUSTER_CIDR} 2>/dev/null
ip route del blackhole {SERVICE_GUARD_CIDR} 2>/dev/null
nft delete table inet {HOST_TABLE} 2>/dev/null
for c in {cgroup_roots}; do
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

/// Runs a command in a node's network namespace (only its network: the mount namespace stays
/// the host's, which kubelet and containerd must share).
pub(super) fn in_netns(slot: Slot, program: &str, args: &[&str]) -> Result<(), TestingError> {
    let netns = format!("--net={}", slot.netns_path().display());
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
