//! The container images the test node runs, built here because no registry is reachable:
//! the pod sandbox (`netkit-pause`), the test workload (`netkit-testbox`) and CoreDNS (built from
//! its Go module, wrapper in `xtask/coredns/`). Each is a `docker load`/OCI tarball under
//! `<assets>/images/` for `ctr -n k8s.io images import`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};
use sha2::{Digest as _, Sha256};

use netkit_testenv::node::{COREDNS_IMAGE, PAUSE_IMAGE, TESTBOX_IMAGE};

use crate::image::{ImageContents, NONROOT, write_image};

/// The CoreDNS release `xtask/coredns/go.mod` requires.
pub const COREDNS_VERSION: &str = "v1.15.0";

/// Builds whatever is stale (CoreDNS, the release testbox binaries) and writes the three
/// tarballs into `<assets>/images/`; a tarball whose contents did not change is left alone.
pub fn ensure(assets: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(assets).with_context(|| format!("creating {}", assets.display()))?;
    let coredns_binary = install_coredns(assets)?;
    let release = build_testbox()?;
    let out = assets.join("images");
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;

    let mut pause = ImageContents::new(NONROOT);
    pause.add_binary("/pause", &release.join("netkit-pause"))?;
    pause.add_nonroot_user();
    pause.entrypoint = vec!["/pause".to_owned()];
    pause.labels = labels("netkit-pause", env!("CARGO_PKG_VERSION"));

    let mut testbox = ImageContents::new(NONROOT);
    testbox.add_binary("/testbox", &release.join("netkit-testbox"))?;
    testbox.add_nonroot_user();
    // Without it glibc asks DNS first and never reads /etc/hosts when DNS answers NXDOMAIN.
    testbox.files.insert(
        "etc/nsswitch.conf".to_owned(),
        (b"hosts: files dns\n".to_vec(), 0o644),
    );
    testbox.entrypoint = vec!["/testbox".to_owned()];
    testbox.labels = labels("netkit-testbox", env!("CARGO_PKG_VERSION"));

    // Static Go binary: no libraries. Port 53 as non-root needs NET_BIND_SERVICE or
    // net.ipv4.ip_unprivileged_port_start in the pod, as with the upstream image.
    let mut coredns = ImageContents::new(NONROOT);
    coredns.add_binary("/coredns", &coredns_binary)?;
    coredns.add_nonroot_user();
    coredns.entrypoint = vec!["/coredns".to_owned()];
    coredns.labels = labels("coredns", COREDNS_VERSION);

    // The references are the harness's, which imports these tarballs on every node start.
    write_if_changed("pause", PAUSE_IMAGE, &pause, &out)?;
    write_if_changed("testbox", TESTBOX_IMAGE, &testbox, &out)?;
    write_if_changed("coredns", COREDNS_IMAGE, &coredns, &out)?;
    Ok(())
}

fn labels(title: &str, version: &str) -> std::collections::BTreeMap<String, String> {
    // No git revision: it would change the image, and force a re-import, on every commit.
    [
        ("org.opencontainers.image.title", title),
        ("org.opencontainers.image.version", version),
        (
            "org.opencontainers.image.source",
            "https://github.com/kube-netkit/kube-netkit",
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// The stamp `<name>.tar.stamp` is a hash of everything that goes into the tarball, so an
/// unchanged image is neither rewritten nor given a new file time.
fn write_if_changed(
    name: &str,
    reference: &'static str,
    contents: &ImageContents,
    out: &Path,
) -> anyhow::Result<()> {
    let tarball = out.join(format!("{name}.tar"));
    let stamp_file = out.join(format!("{name}.tar.stamp"));
    let hash = contents_hash(reference, contents)?;
    let current = std::fs::read_to_string(&stamp_file).unwrap_or_default();
    if current.trim() == format!("{hash} {}", file_identity(&tarball)) {
        return Ok(());
    }
    let built = write_image(name, reference, contents, out)?;
    // The tarball's size and time too: a tarball replaced by anything else is rewritten.
    let stamp = format!("{hash} {}", file_identity(&built.tarball));
    std::fs::write(&stamp_file, &stamp)
        .with_context(|| format!("writing {}", stamp_file.display()))?;
    eprintln!(
        "wrote {} ({reference}, {})",
        built.tarball.display(),
        built.manifest_digest
    );
    Ok(())
}

/// `len:mtime-in-nanoseconds`, or `missing`.
fn file_identity(path: &Path) -> String {
    std::fs::metadata(path)
        .ok()
        .and_then(|m| {
            let modified = m
                .modified()
                .ok()?
                .duration_since(std::time::UNIX_EPOCH)
                .ok()?;
            Some(format!("{}:{}", m.len(), modified.as_nanos()))
        })
        .unwrap_or_else(|| "missing".to_owned())
}

fn contents_hash(reference: &str, contents: &ImageContents) -> anyhow::Result<String> {
    let mut hasher = Sha256::new();
    let config = serde_json::json!({
        "reference": reference,
        "entrypoint": contents.entrypoint,
        "user": contents.user,
        "env": contents.env,
        "labels": contents.labels,
        "epoch": std::env::var("SOURCE_DATE_EPOCH").unwrap_or_default(),
    });
    hasher.update(serde_json::to_vec(&config)?);
    for (path, (bytes, mode)) in &contents.files {
        // Lengths first, so no two different file lists hash the same byte stream.
        hasher.update((path.len() as u64).to_le_bytes());
        hasher.update(path.as_bytes());
        hasher.update(mode.to_le_bytes());
        hasher.update((bytes.len() as u64).to_le_bytes());
        hasher.update(bytes);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// `cargo build --release -p netkit-testbox`; returns the directory holding both binaries.
fn build_testbox() -> anyhow::Result<PathBuf> {
    let root = netkit_testenv::workspace::root();
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    cmd.current_dir(&root)
        .args(["build", "--release", "-p", "netkit-testbox"]);
    netkit_testenv::workspace::without_run_env(&mut cmd);
    let status = cmd
        .status()
        .context("running cargo build --release -p netkit-testbox")?;
    if !status.success() {
        bail!("release build of netkit-testbox failed ({status})");
    }
    Ok(netkit_testenv::workspace::target_dir(&root).join("release"))
}

/// Builds CoreDNS into `<assets>/coredns` unless the stamp (version, go.mod, go.sum) matches.
fn install_coredns(assets: &Path) -> anyhow::Result<PathBuf> {
    let module = netkit_testenv::workspace::root()
        .join("xtask")
        .join("coredns");
    let go_mod = std::fs::read(module.join("go.mod")).context("reading xtask/coredns/go.mod")?;
    let go_sum = std::fs::read(module.join("go.sum")).context("reading xtask/coredns/go.sum")?;
    let mut hasher = Sha256::new();
    hasher.update(COREDNS_VERSION.as_bytes());
    hasher.update(&go_mod);
    hasher.update(&go_sum);
    let stamp = hex::encode(hasher.finalize());
    let target = assets.join("coredns");
    let stamp_file = assets.join("coredns.stamp");
    let current = std::fs::read_to_string(&stamp_file).unwrap_or_default();
    if target.is_file() && current.trim() == stamp {
        return Ok(target);
    }
    eprintln!(
        "building CoreDNS {COREDNS_VERSION} from the Go module github.com/coredns/coredns (a few minutes the first time)..."
    );
    let started = std::time::Instant::now();
    let partial = assets.join("coredns.partial");
    let status = Command::new("go")
        .current_dir(&module)
        .env("CGO_ENABLED", "0")
        .env("GOTOOLCHAIN", "local")
        .env_remove("GOFLAGS")
        .args(["build", "-trimpath", "-ldflags", "-s -w", "-o"])
        .arg(&partial)
        .arg("github.com/coredns/coredns")
        .status()
        .context("running go build (Go >= 1.26 is needed to build CoreDNS)")?;
    if !status.success() {
        bail!("go build of CoreDNS failed ({status})");
    }
    std::fs::rename(&partial, &target)
        .with_context(|| format!("renaming to {}", target.display()))?;
    std::fs::write(&stamp_file, &stamp)
        .with_context(|| format!("writing {}", stamp_file.display()))?;
    eprintln!("built {} in {:.0?}", target.display(), started.elapsed());
    Ok(target)
}

/// The Debian package the HAProxy sidecar image of the e2e is made from.
const HAPROXY_PACKAGE: &str = "haproxy";
/// Where Debian's package puts the binary.
const HAPROXY_BINARY: &str = "/usr/sbin/haproxy";

/// The HAProxy sidecar image pod-proxier's `backend=haproxy` runs on the node (no registry is
/// reachable, so no upstream `haproxy` image): Debian's haproxy binary with the shared libraries
/// `ldd` names, the non-root user, entrypoint the binary (the chart passes `-db -f <config>`),
/// written like the release images into `target/images/haproxy{,.tar}`. The package is
/// installed if missing, as `cargo xtask test` installs it; the tag is the installed package's
/// version (`+`/`~` made `-`), also in the image's labels, so the image names the exact build
/// it holds.
pub fn haproxy_image() -> anyhow::Result<netkit_testenv::images::Built> {
    netkit_testenv::debian::install_packages(
        &[HAPROXY_PACKAGE],
        "the e2e's HAProxy sidecar image",
    )?;
    let output = Command::new("dpkg-query")
        .args(["-W", "-f", "${Version}", HAPROXY_PACKAGE])
        .output()
        .context("running dpkg-query")?;
    let version = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if !output.status.success() || version.is_empty() {
        bail!("dpkg-query found no version of {HAPROXY_PACKAGE}");
    }
    let tag: String = version
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    let mut haproxy = ImageContents::new(NONROOT);
    haproxy.add_binary("/haproxy", Path::new(HAPROXY_BINARY))?;
    haproxy.add_nonroot_user();
    haproxy.entrypoint = vec!["/haproxy".to_owned()];
    haproxy.labels = labels("haproxy", &version);
    haproxy.labels.insert(
        "io.kube-netkit.debian-package".to_owned(),
        format!("{HAPROXY_PACKAGE}={version}"),
    );
    let reference = format!("localhost/kube-netkit/haproxy:{tag}");
    let out = crate::image::images_dir(&netkit_testenv::workspace::root());
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    write_image("haproxy", &reference, &haproxy, &out)
}
