//! A node leaves nothing on the machine when its test binary is killed: no process, mount,
//! network namespace, route, nftables table, cgroup or file. (A binary of its own: one node per
//! machine at a time, and the other node tests share theirs.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use netkit_testenv::ControlPlane;
use netkit_testenv::node;

#[tokio::test]
async fn a_killed_test_binary_leaves_nothing_behind() {
    if std::env::var_os("NODE_PROBE").is_some() {
        return probe_child().await;
    }
    // A node of an earlier test binary may still be tearing down: its guardian holds the lock
    // until it is done.
    let waited = std::process::Command::new("flock")
        .args([node::MACHINE_LOCK, "true"])
        .status()
        .unwrap();
    assert!(waited.success());
    // Its processes were killed before the lock was released, but may still be exiting.
    let settled = Instant::now();
    while !machine_state().processes.is_empty() && settled.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let before = machine_state();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_killed_test_binary_leaves_nothing_behind",
            "--nocapture",
        ])
        .env("NODE_PROBE", "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        use std::io::BufRead as _;
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| l.strip_prefix("PROBE ").map(str::to_owned))
    })
    .await
    .unwrap()
    .expect("the child printed what it started");
    let during = machine_state();
    assert!(during.netns.contains(&"knk-node".to_owned()), "{during:?}");
    assert!(during.nft.contains("kube_netkit_node"), "{during:?}");

    // SIGKILL: no destructor runs; only the guardians can clean up.
    child.kill().unwrap();
    child.wait().unwrap();

    let (pids, dirs) = line.split_once(" dirs=").unwrap();
    let pids: Vec<u32> = pids
        .trim_start_matches("pids=")
        .split(',')
        .map(|p| p.parse().unwrap())
        .collect();
    let dirs: Vec<&str> = dirs.split(',').collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let alive: Vec<u32> = pids.iter().copied().filter(|p| alive(*p)).collect();
        let left: Vec<&&str> = dirs
            .iter()
            .filter(|d| std::path::Path::new(d).exists())
            .collect();
        let state = machine_state();
        if alive.is_empty() && left.is_empty() && state == before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left behind: processes {alive:?}, directories {left:?}, machine state {state:?} (before: {before:?})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .unwrap()
            .trim(),
        before.ip_forward
    );
}

/// The child's part: start a node, print what it made, wait to be killed.
async fn probe_child() {
    let plane = ControlPlane::shared_with_node()
        .await
        .unwrap_or_else(|err| panic!("{err}"));
    let node = plane.node().unwrap();
    let mut pids = plane.pids();
    pids.extend(node.pids());
    println!(
        "PROBE pids={} dirs={},{}",
        pids.iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(","),
        plane.dir().display(),
        node.dir().display()
    );
    tokio::time::sleep(Duration::from_secs(600)).await;
}

/// What a node may change on the machine, read the way an administrator would.
#[derive(Debug, PartialEq, Eq)]
struct MachineState {
    netns: Vec<String>,
    routes: String,
    links: String,
    nft: String,
    mounts: Vec<String>,
    cgroups: Vec<String>,
    processes: Vec<String>,
    ip_forward: String,
}

fn machine_state() -> MachineState {
    let run = |program: &str, args: &[&str]| {
        let out = std::process::Command::new(program)
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let mut netns: Vec<String> = std::fs::read_dir("/run/netns")
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    netns.sort();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains("kube-netkit") || l.contains("/run/netns/") || l.contains("kubelet"))
        .map(str::to_owned)
        .collect();
    let mut cgroups: Vec<String> = std::fs::read_dir("/sys/fs/cgroup")
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.path().join("kube-netkit-node").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    cgroups.sort();
    let mut processes: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        // A zombie holds nothing but its pid until its parent (often init) reaps it.
        .filter(|e| {
            std::fs::read_to_string(e.path().join("stat"))
                .ok()
                .and_then(|stat| {
                    stat.rsplit_once(')')
                        .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
                })
                .unwrap_or(false)
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
        .map(|c| c.trim().to_owned())
        .filter(|c| {
            [
                "kubelet",
                "kube-proxy",
                "containerd",
                "containerd-shim",
                "kube-controller",
                "kube-scheduler",
                "coredns",
                "testbox",
                "pause",
            ]
            .iter()
            .any(|name| c.starts_with(name))
        })
        .collect();
    processes.sort();
    MachineState {
        netns,
        routes: run("ip", &["route", "show", "table", "all"]),
        links: run("ip", &["-o", "link", "show"])
            .lines()
            .map(|l| l.split(':').nth(1).unwrap_or_default().trim().to_owned())
            .collect::<Vec<_>>()
            .join(" "),
        nft: run("nft", &["list", "tables"]),
        mounts,
        cgroups,
        processes,
        ip_forward: std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .unwrap()
            .trim()
            .to_owned(),
    }
}

fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}
