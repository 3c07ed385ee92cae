//! What a node needs from the machine: root, the host tools, the Kubernetes binaries and the node
//! images, all found before anything starts.

use std::path::{Path, PathBuf};

use super::super::TestingError;
use super::super::assets::{default_assets_dir, locate_in_assets};

/// The node images `cargo xtask envtest --node` writes into `<assets>/images/`, by file name.
const NODE_IMAGES: [&str; 3] = ["pause.tar", "coredns.tar", "testbox.tar"];

/// Host programs the node runs or calls.
const HOST_TOOLS: [&str; 10] = [
    "flock",
    "containerd",
    "containerd-shim-runc-v2",
    "runc",
    "ctr",
    "ip",
    "nft",
    "iptables",
    "nsenter",
    "conntrack",
];

/// Everything a node needs from the machine, found before anything is started.
#[derive(Debug, Clone)]
pub(crate) struct NodeAssets {
    pub(super) kubelet: PathBuf,
    pub(super) kube_proxy: PathBuf,
    pub(super) kube_controller_manager: PathBuf,
    pub(super) kube_scheduler: PathBuf,
    pub(super) images: Vec<PathBuf>,
}

impl NodeAssets {
    /// Finds the binaries and images and checks root and the host tools; one line names all
    /// that is missing.
    pub(crate) fn locate() -> Result<Self, TestingError> {
        let mut missing = Vec::new();
        if !is_root() {
            missing.push("root (the node makes network namespaces, mounts and cgroups)".to_owned());
        }
        for tool in HOST_TOOLS {
            if find_in_path(tool).is_none() {
                missing.push(format!("`{tool}` on PATH"));
            }
        }
        if !Path::new("/usr/lib/cni/bridge").is_file() {
            missing
                .push("the CNI plugins in /usr/lib/cni (containernetworking-plugins)".to_owned());
        }
        let mut found = |name: &str| match locate_in_assets(name) {
            Ok(path) => path,
            Err(_) => {
                missing.push(format!("`{name}`"));
                PathBuf::new()
            }
        };
        let kubelet = found("kubelet");
        let kube_proxy = found("kube-proxy");
        let kube_controller_manager = found("kube-controller-manager");
        let kube_scheduler = found("kube-scheduler");
        let images_dir = default_assets_dir().unwrap_or_default().join("images");
        let images: Vec<PathBuf> = NODE_IMAGES.iter().map(|f| images_dir.join(f)).collect();
        for image in &images {
            if !image.is_file() {
                missing.push(format!("the image {}", image.display()));
            }
        }
        if missing.is_empty() {
            return Ok(Self {
                kubelet,
                kube_proxy,
                kube_controller_manager,
                kube_scheduler,
                images,
            });
        }
        Err(TestingError::NodeUnavailable(format!(
            "missing {}; `cargo xtask envtest --node` (as root, on Debian) installs them",
            missing.join(", ")
        )))
    }
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_string_lossy()
        .split(':')
        .map(|dir| Path::new(dir).join(name))
        .find(|p| p.is_file())
}
