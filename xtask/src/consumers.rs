//! `cargo xtask consumers`: k8s-reconcile as another project uses it.
//!
//! For each Kubernetes version in [`VERSIONS`], writes a small crate in a temporary directory
//! outside the workspace that depends on `k8s-reconcile` by path (default features only) and on
//! `k8s-openapi` with that version's feature, whose `main.rs` is the crate docs' example
//! (`k8s-reconcile/examples/secret_mirror.rs`, unchanged). Each is built on its own, then run
//! against the test control plane: it must mirror a Secret's keys into a ConfigMap, follow an
//! edit of the Secret, and exit 0 on SIGTERM. A library that picked a Kubernetes version itself
//! fails the build here, as it would fail a user's.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, Patch, PatchParams, PostParams};
use netkit_testenv::ControlPlane;

/// The `k8s-openapi` features the outside crates are built with, and what each means.
const VERSIONS: [(&str, &str); 2] = [("earliest", "1.33"), ("v1_35", "1.35")];

/// The crate docs' example, the program every outside crate runs.
const EXAMPLE: &str = "k8s-reconcile/examples/secret_mirror.rs";

pub fn run() -> anyhow::Result<()> {
    let root = netkit_testenv::workspace::root();
    let base = std::env::temp_dir().join("kube-netkit-consumers");
    if base.starts_with(&root) {
        bail!("{} is inside the workspace", base.display());
    }
    // One target directory for both, outside the crates, so dependencies that do not depend on
    // the version (tokio, rustls, ...) build once and stay cached between runs.
    let target = root.join("target").join("consumers");
    let mut built = Vec::new();
    for (feature, version) in VERSIONS {
        let dir = base.join(format!("on-{feature}"));
        write_crate(&root, &dir, feature)?;
        let started = Instant::now();
        eprintln!(
            "==> building an outside crate on k8s-openapi `{feature}` (Kubernetes {version})"
        );
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(&dir)
            .args(["build", "--offline"])
            .env("CARGO_TARGET_DIR", &target)
            // The outside crate must stand on its own, not on this workspace's settings.
            .env_remove("K8S_OPENAPI_ENABLED_VERSION")
            .env_remove("RUSTFLAGS")
            .status()
            .context("running cargo build")?;
        if !status.success() {
            bail!("the outside crate on `{feature}` does not build (see above)");
        }
        let binary = target
            .join("debug")
            .join(format!("consumer-{}", feature.replace('_', "-")));
        eprintln!(
            "    built in {:.1?}: {}",
            started.elapsed(),
            binary.display()
        );
        built.push((feature, version, binary));
    }

    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let plane = ControlPlane::shared().await?;
        for (feature, version, binary) in &built {
            run_consumer(plane, feature, version, binary).await?;
        }
        anyhow::Ok(())
    })?;
    eprintln!(
        "outside crates: {} built and ran the crate docs' controller",
        built.len()
    );
    Ok(())
}

/// Writes the outside crate: a manifest as a user would write it, the example as `main.rs`, and
/// the workspace's lock file so it builds offline with the versions CI already has.
fn write_crate(root: &Path, dir: &Path, feature: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir.join("src"))?;
    let manifest = format!(
        r#"[package]
name = "consumer-{name}"
version = "0.0.0"
edition = "2024"
publish = false

# Not part of any workspace above it.
[workspace]

[dependencies]
k8s-reconcile = {{ path = "{lib}" }}
k8s-openapi = {{ version = "0.29", features = ["{feature}"] }}
tokio = {{ version = "1", features = ["macros", "rt-multi-thread"] }}
"#,
        name = feature.replace('_', "-"),
        lib = root.join("k8s-reconcile").display(),
    );
    std::fs::write(dir.join("Cargo.toml"), manifest)?;
    std::fs::copy(root.join(EXAMPLE), dir.join("src/main.rs"))
        .with_context(|| format!("copying {EXAMPLE}"))?;
    // Offline, cargo keeps every version the lock file names and only trims what this crate
    // does not use.
    let lock = std::fs::read_to_string(root.join("Cargo.lock"))?;
    std::fs::write(dir.join("Cargo.lock"), lock)?;
    Ok(())
}

/// Runs one outside crate's binary against the control plane and checks what it does.
async fn run_consumer(
    plane: &ControlPlane,
    feature: &str,
    version: &str,
    binary: &PathBuf,
) -> anyhow::Result<()> {
    eprintln!("==> running the crate docs' controller built on `{feature}` (Kubernetes {version})");
    let namespace = plane.create_namespace("consumer").await?;
    let client = plane.client().await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let config_maps: Api<ConfigMap> = Api::namespaced(client, &namespace);

    let mut child = KillOnDrop(
        Command::new(binary)
            .env("KUBECONFIG", plane.kubeconfig_path())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?,
    );

    let mut secret = Secret::default();
    secret.metadata.name = Some("db".into());
    secret.data = Some(
        [("user", "app"), ("password", "hunter2")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), ByteString(v.as_bytes().to_vec())))
            .collect(),
    );
    let started = Instant::now();
    secrets.create(&PostParams::default(), &secret).await?;
    wait_for_keys(&config_maps, &["password", "user"], &mut child).await?;
    let mirrored = started.elapsed();

    // An edit reaches the running controller through its watch.
    let patch = serde_json::json!({ "stringData": { "token": "t" } });
    let started = Instant::now();
    secrets
        .patch("db", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    wait_for_keys(&config_maps, &["password", "token", "user"], &mut child).await?;
    let followed = started.elapsed();

    let owner = config_maps
        .get("db-keys")
        .await?
        .metadata
        .owner_references
        .unwrap_or_default();
    if !owner
        .iter()
        .any(|o| o.kind == "Secret" && o.name == "db" && o.controller == Some(true))
    {
        bail!("db-keys is not owned by the Secret db: {owner:?}");
    }

    let pid = rustix::process::Pid::from_raw(i32::try_from(child.0.id())?)
        .context("the child has no pid")?;
    rustix::process::kill_process(pid, rustix::process::Signal::TERM)?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.0.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            bail!("the controller did not exit within 20 s of SIGTERM");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    if !status.success() {
        bail!("the controller exited with {status} after SIGTERM");
    }
    eprintln!(
        "    ok: keys mirrored {} ms after the Secret was created, an edit followed in {} ms, \
         owner reference set, exit 0 on SIGTERM",
        mirrored.as_millis(),
        followed.as_millis()
    );
    Ok(())
}

/// Waits until `db-keys` lists exactly `keys`, failing early if the controller exits.
async fn wait_for_keys(
    config_maps: &Api<ConfigMap>,
    keys: &[&str],
    child: &mut KillOnDrop,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = None;
    loop {
        if let Some(status) = child.0.try_wait()? {
            bail!("the controller exited early with {status}");
        }
        if let Some(cm) = config_maps.get_opt("db-keys").await? {
            let have: Vec<String> = cm.data.unwrap_or_default().into_keys().collect();
            if have == keys {
                return Ok(());
            }
            last = Some(have);
        }
        if Instant::now() > deadline {
            bail!("db-keys never listed {keys:?} within 60 s (last seen: {last:?})");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A child process killed when dropped, so a failed check leaves nothing running.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
