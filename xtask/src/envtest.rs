//! `cargo xtask envtest`: kube-apiserver built from the Go module `k8s.io/kubernetes` (wrapper module
//! in `xtask/kubernetes/`), etcd copied out of the `etcd-bin-vendored-linux-amd64` crate, both
//! into a versioned cache directory outside the repository.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};
use netkit_testenv::{ASSETS_DIR_ENV, KUBERNETES_VERSION, default_assets_dir};
use sha2::{Digest as _, Sha256};

#[derive(clap::Args, Default)]
pub struct Args {
    /// Rebuild the Kubernetes binaries even if the cached ones match.
    #[arg(long)]
    pub force: bool,
    /// Also install what a test node needs: kubelet, kube-proxy, kube-controller-manager and
    /// kube-scheduler (same module), containerd/runc/CNI plugins (Debian), CoreDNS and the node
    /// images.
    #[arg(long)]
    pub node: bool,
}

/// Makes sure both binaries exist and returns the directory holding them.
pub fn ensure(args: &Args) -> anyhow::Result<PathBuf> {
    // A user who already has envtest binaries needs neither Go nor a build.
    if let Some(dir) = user_assets()? {
        return Ok(dir);
    }
    let dir = default_assets_dir().with_context(|| {
        format!("cannot choose a cache directory: set {ASSETS_DIR_ENV} or HOME")
    })?;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    install_etcd(&dir)?;
    install_kube_apiserver(&dir, args.force)?;
    if args.node {
        netkit_testenv::debian::install_packages(&NODE_PACKAGES, "the test node")?;
        build_kubernetes(&dir, &NODE_BINARIES, args.force)?;
        crate::node_images::ensure(&dir)?;
    }
    Ok(dir)
}

/// `KUBEBUILDER_ASSETS` or `TEST_ASSET_*` pointing at existing binaries.
fn user_assets() -> anyhow::Result<Option<PathBuf>> {
    let apiserver = std::env::var_os("TEST_ASSET_KUBE_APISERVER").filter(|v| !v.is_empty());
    let etcd = std::env::var_os("TEST_ASSET_ETCD").filter(|v| !v.is_empty());
    if let (Some(apiserver), Some(etcd)) = (&apiserver, &etcd) {
        for path in [apiserver, etcd] {
            if !Path::new(path).is_file() {
                bail!(
                    "TEST_ASSET_* names {}, which does not exist",
                    Path::new(path).display()
                );
            }
        }
        return Ok(Path::new(apiserver).parent().map(Path::to_path_buf));
    }
    if let Some(dir) = std::env::var_os("KUBEBUILDER_ASSETS").filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        for name in ["kube-apiserver", "etcd"] {
            if !dir.join(name).is_file() {
                bail!("KUBEBUILDER_ASSETS={} holds no {name}", dir.display());
            }
        }
        return Ok(Some(dir));
    }
    Ok(None)
}

fn install_etcd(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let Ok(source) = etcd_bin_vendored_linux_amd64::etcd_bin_path();
    let target = dir.join("etcd");
    let source_len = std::fs::metadata(source)
        .with_context(|| format!("the etcd crate's binary {} is missing", source.display()))?
        .len();
    let up_to_date = std::fs::metadata(&target).is_ok_and(|m| m.len() == source_len);
    if !up_to_date {
        let partial = dir.join("etcd.partial");
        std::fs::copy(source, &partial)
            .with_context(|| format!("copying {} to {}", source.display(), partial.display()))?;
        std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o755))?;
        std::fs::rename(&partial, &target)?;
        eprintln!("installed etcd into {}", target.display());
    }
    Ok(())
}

/// The Kubernetes programs `--node` adds, built from the same wrapper module as kube-apiserver.
const NODE_BINARIES: [&str; 4] = [
    "kubelet",
    "kube-proxy",
    "kube-controller-manager",
    "kube-scheduler",
];

/// Debian packages a node needs: the container runtime, the CNI plugins and the netfilter tools
/// kubelet and kube-proxy call.
const NODE_PACKAGES: [&str; 7] = [
    "containerd",
    "runc",
    "containernetworking-plugins",
    "iptables",
    "nftables",
    "conntrack",
    "iproute2",
];

fn install_kube_apiserver(dir: &Path, force: bool) -> anyhow::Result<()> {
    build_kubernetes(dir, &["kube-apiserver"], force)
}

/// Builds `programs` (each `k8s.io/kubernetes/cmd/<name>`) from `xtask/kubernetes/` into `dir`
/// unless each is there with a stamp of the module it was built from (a changed `go.sum` forces a
/// rebuild). One `go build` for all of them, so shared packages compile once.
fn build_kubernetes(dir: &Path, programs: &[&str], force: bool) -> anyhow::Result<()> {
    let module = netkit_testenv::workspace::root()
        .join("xtask")
        .join("kubernetes");
    let go_sum = std::fs::read(module.join("go.sum")).context("reading xtask/kubernetes/go.sum")?;
    let go_mod = std::fs::read(module.join("go.mod")).context("reading xtask/kubernetes/go.mod")?;
    let mut hasher = Sha256::new();
    hasher.update(KUBERNETES_VERSION.as_bytes());
    hasher.update(&go_mod);
    hasher.update(&go_sum);
    let stamp = hex::encode(hasher.finalize());
    let stale: Vec<&str> = programs
        .iter()
        .copied()
        .filter(|name| {
            let current =
                std::fs::read_to_string(dir.join(format!("{name}.stamp"))).unwrap_or_default();
            force || !dir.join(name).is_file() || current.trim() != stamp
        })
        .collect();
    if stale.is_empty() {
        return Ok(());
    }
    check_go()?;
    eprintln!(
        "building {} {KUBERNETES_VERSION} from the Go module k8s.io/kubernetes (minutes the first time)...",
        stale.join(", ")
    );
    let started = std::time::Instant::now();
    let minor = KUBERNETES_VERSION.split('.').nth(1).unwrap_or_default();
    let ldflags = [
        "-s -w".to_owned(),
        format!("-X k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION}"),
        "-X k8s.io/component-base/version.gitMajor=1".to_owned(),
        format!("-X k8s.io/component-base/version.gitMinor={minor}"),
        "-X k8s.io/component-base/version.gitTreeState=clean".to_owned(),
        format!("-X k8s.io/client-go/pkg/version.gitVersion={KUBERNETES_VERSION}"),
        "-X k8s.io/client-go/pkg/version.gitMajor=1".to_owned(),
        format!("-X k8s.io/client-go/pkg/version.gitMinor={minor}"),
    ]
    .join(" ");
    let partial = dir.join("build.partial");
    std::fs::create_dir_all(&partial)?;
    let status = Command::new("go")
        .current_dir(&module)
        .env("CGO_ENABLED", "0")
        .env("GOTOOLCHAIN", "local")
        .env_remove("GOFLAGS")
        .args(["build", "-trimpath", "-ldflags", &ldflags, "-o"])
        .arg(format!("{}/", partial.display()))
        .args(
            stale
                .iter()
                .map(|name| format!("k8s.io/kubernetes/cmd/{name}")),
        )
        .status()
        .context("running go build")?;
    if !status.success() {
        bail!("go build of {} failed ({status})", stale.join(", "));
    }
    for name in &stale {
        std::fs::rename(partial.join(name), dir.join(name))?;
        std::fs::write(dir.join(format!("{name}.stamp")), &stamp)?;
    }
    std::fs::remove_dir_all(&partial)?;
    eprintln!("built {} in {:.0?}", stale.join(", "), started.elapsed());
    Ok(())
}

fn check_go() -> anyhow::Result<()> {
    let output = Command::new("go")
        .arg("version")
        .env("GOTOOLCHAIN", "local")
        .output();
    match output {
        Ok(out) if out.status.success() => Ok(()),
        _ => bail!(
            "Go (>= 1.26) is needed once to build kube-apiserver {KUBERNETES_VERSION}; install it, \
             or set KUBEBUILDER_ASSETS to a directory holding kube-apiserver and etcd"
        ),
    }
}
