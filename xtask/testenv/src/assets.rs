//! Where the control-plane binaries live.
//!
//! The lookup order is the one of controller-runtime's envtest, so a machine that already has envtest
//! binaries needs nothing else:
//!
//! 1. `TEST_ASSET_KUBE_APISERVER` and `TEST_ASSET_ETCD`: full paths to each binary;
//! 2. `KUBEBUILDER_ASSETS`: a directory holding `kube-apiserver` and `etcd`;
//! 3. the project's cache directory, filled by `cargo xtask envtest` (see [`default_assets_dir`]);
//! 4. `/usr/local/kubebuilder/bin`.

use std::path::{Path, PathBuf};

use super::TestingError;

/// The Kubernetes version that `cargo xtask envtest` builds.
pub const KUBERNETES_VERSION: &str = "v1.37.2";

/// The etcd version that `cargo xtask envtest` installs.
pub const ETCD_VERSION: &str = "3.7.2";

/// Environment variable that overrides the cache directory of [`default_assets_dir`].
pub const ASSETS_DIR_ENV: &str = "NETKIT_ENVTEST_DIR";

/// The directory `cargo xtask envtest` installs into: `$NETKIT_ENVTEST_DIR` if set, else
/// `$XDG_CACHE_HOME/kube-netkit/envtest/<version>`, else `$HOME/.cache/kube-netkit/envtest/<version>`.
pub fn default_assets_dir() -> Option<PathBuf> {
    if let Some(dir) = non_empty_env(ASSETS_DIR_ENV) {
        return Some(PathBuf::from(dir));
    }
    let cache = non_empty_env("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| non_empty_env("HOME").map(|home| Path::new(&home).join(".cache")))?;
    Some(
        cache
            .join("kube-netkit")
            .join("envtest")
            .join(KUBERNETES_VERSION),
    )
}

/// Paths of the two binaries a control plane runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binaries {
    /// The `kube-apiserver` executable.
    pub kube_apiserver: PathBuf,
    /// The `etcd` executable.
    pub etcd: PathBuf,
}

impl Binaries {
    /// Finds both binaries in the envtest lookup order and checks that they are executable files.
    ///
    /// The error names `cargo xtask envtest`, which installs them.
    pub fn locate() -> Result<Self, TestingError> {
        let kube_apiserver = locate_one("kube-apiserver", "TEST_ASSET_KUBE_APISERVER")?;
        let etcd = locate_one("etcd", "TEST_ASSET_ETCD")?;
        Ok(Self {
            kube_apiserver,
            etcd,
        })
    }
}

/// Finds another Kubernetes binary (e.g. `kubelet`) the way [`Binaries::locate`] finds the API
/// server: `TEST_ASSET_<NAME>` (upper case, `-` as `_`), then the asset directories.
pub(super) fn locate_in_assets(name: &str) -> Result<PathBuf, TestingError> {
    let explicit = format!("TEST_ASSET_{}", name.to_ascii_uppercase().replace('-', "_"));
    locate_one(name, &explicit)
}

fn locate_one(name: &str, explicit_env: &str) -> Result<PathBuf, TestingError> {
    let mut tried = Vec::new();
    if let Some(path) = non_empty_env(explicit_env) {
        // An explicit path is a promise: if it is wrong, say so instead of looking elsewhere.
        let path = PathBuf::from(path);
        return match check_executable(&path) {
            Ok(()) => Ok(path),
            Err(reason) => Err(TestingError::BinaryMissing {
                name: name.to_owned(),
                tried: vec![format!("{explicit_env}={} ({reason})", path.display())],
            }),
        };
    }
    let mut dirs = Vec::new();
    if let Some(dir) = non_empty_env("KUBEBUILDER_ASSETS") {
        dirs.push(PathBuf::from(dir));
    }
    dirs.extend(default_assets_dir());
    dirs.push(PathBuf::from("/usr/local/kubebuilder/bin"));
    for dir in dirs {
        let candidate = dir.join(name);
        match check_executable(&candidate) {
            Ok(()) => return Ok(candidate),
            Err(reason) => tried.push(format!("{} ({reason})", candidate.display())),
        }
    }
    Err(TestingError::BinaryMissing {
        name: name.to_owned(),
        tried,
    })
}

fn check_executable(path: &Path) -> Result<(), &'static str> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|_| "not found")?;
    if !meta.is_file() {
        return Err("not a file");
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Err("not executable");
    }
    Ok(())
}

fn non_empty_env(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

/// The Helm version `cargo xtask helm` builds (and `cargo xtask test` provides to tests).
pub const HELM_VERSION: &str = "v3.22.0";

/// Environment variable naming the Helm binary for tests.
pub const HELM_ENV: &str = "NETKIT_HELM";

/// Where `cargo xtask helm` installs Helm: `<cache>/kube-netkit/tools/helm-<version>/helm`.
pub fn default_helm_path() -> Option<PathBuf> {
    let assets = default_assets_dir()?;
    Some(
        assets
            .parent()?
            .parent()?
            .join("tools")
            .join(format!("helm-{HELM_VERSION}"))
            .join("helm"),
    )
}

/// Helm for chart tests: `$NETKIT_HELM`, else the one `cargo xtask helm` installed. The error
/// names the command that installs it.
pub fn helm() -> Result<PathBuf, TestingError> {
    let candidate = non_empty_env(HELM_ENV)
        .map(PathBuf::from)
        .or_else(default_helm_path);
    let tried = candidate
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "no path (HOME unset)".to_owned());
    match candidate {
        Some(path) if check_executable(&path).is_ok() => Ok(path),
        _ => Err(TestingError::BinaryMissing {
            name: format!("helm {HELM_VERSION}"),
            tried: vec![tried],
        }),
    }
}
