//! `cargo xtask image`: release OCI images without a container engine (the approach of ko/jib).
//!
//! One uncompressed layer holds the binaries, the shared libraries `ldd` says they need, CA
//! certificates and a passwd/group with the non-root user 65532. Every tar entry has a fixed
//! owner and mtime (`SOURCE_DATE_EPOCH`, else 0) and the entries are sorted, so the same binaries
//! always give the same digest. Written under `target/images/<name>/` as an OCI image layout and
//! as `target/images/<name>.tar`, which `docker load` (classic `manifest.json`) and OCI tools
//! (`oci-layout`, `index.json`) both read.
//!
//! [`ImageContents`] and [`write_image`] are the writer alone, for any single-layer image; the
//! test node's images (`node_images`) use them too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};
use netkit_testenv::images::Built;
use netkit_testenv::workspace::{target_dir, without_run_env};
use sha2::{Digest as _, Sha256};

/// The default registry path, as the charts reference it.
pub const DEFAULT_REPOSITORY: &str = "ghcr.io/kube-netkit";
/// The non-root user and group of every image.
pub const NONROOT: u32 = 65532;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Which image: steward-tcp-proxy, rstream-operator, pod-proxier, or all.
    #[arg(default_value = "all")]
    pub which: String,
    /// Registry path the image names start with.
    #[arg(long, default_value = DEFAULT_REPOSITORY)]
    pub repository: String,
    /// Image tag (default: the workspace version).
    #[arg(long)]
    pub tag: Option<String>,
    /// Package the existing release binaries instead of building them.
    #[arg(long)]
    pub skip_build: bool,
}

/// One image: its name, crate, and binaries (file in target/release -> path in the image).
pub struct ImageSpec {
    pub name: &'static str,
    pub package: &'static str,
    pub binaries: &'static [(&'static str, &'static str)],
}

pub const IMAGES: &[ImageSpec] = &[
    ImageSpec {
        name: "steward-tcp-proxy",
        package: "steward-tcp-proxy",
        binaries: &[("steward-tcp-proxy", "/steward-tcp-proxy")],
    },
    ImageSpec {
        name: "rstream-operator",
        package: "rstream-operator",
        binaries: &[
            ("rstream-operator", "/manager"),
            ("rstream-agent", "/rstream-agent"),
        ],
    },
    ImageSpec {
        name: "pod-proxier",
        package: "pod-proxier",
        binaries: &[("pod-proxier", "/pod-proxier")],
    },
];

pub fn run(args: &Args) -> anyhow::Result<Vec<Built>> {
    let specs = selected(&args.which)?;
    if !args.skip_build {
        let status = release_build(&specs)
            .status()
            .context("running cargo build --release")?;
        if !status.success() {
            bail!("release build failed ({status})");
        }
    }
    let built = package(&specs, &args.repository, args.tag.as_deref())?;
    for image in &built {
        println!(
            "{}  {}  {}",
            image.reference,
            image.manifest_digest,
            image.tarball.display()
        );
    }
    Ok(built)
}

/// The images `which` names: one image's name, or `all`.
pub fn selected(which: &str) -> anyhow::Result<Vec<&'static ImageSpec>> {
    Ok(match which {
        "all" => IMAGES.iter().collect(),
        name => vec![IMAGES.iter().find(|s| s.name == name).with_context(|| {
            format!(
                "unknown image {name:?}: steward-tcp-proxy, rstream-operator, pod-proxier or all"
            )
        })?],
    })
}

/// `cargo build --release` of the packages of `specs`, in the workspace root, without the
/// environment `cargo run` gave this process.
pub fn release_build(specs: &[&ImageSpec]) -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    cmd.current_dir(netkit_testenv::workspace::root())
        .args(["build", "--release"]);
    without_run_env(&mut cmd);
    for spec in specs {
        cmd.args(["-p", spec.package]);
    }
    cmd
}

/// Writes the images of `specs` from the release binaries already built (`tag` defaults to the
/// workspace version); prints nothing.
pub fn package(
    specs: &[&ImageSpec],
    repository: &str,
    tag: Option<&str>,
) -> anyhow::Result<Vec<Built>> {
    let root = netkit_testenv::workspace::root();
    let tag = tag.unwrap_or(env!("CARGO_PKG_VERSION"));
    specs
        .iter()
        .map(|spec| build_image(&root, spec, repository, tag))
        .collect()
}

fn build_image(
    root: &Path,
    spec: &ImageSpec,
    repository: &str,
    tag: &str,
) -> anyhow::Result<Built> {
    let release = target_dir(root).join("release");
    let mut contents = ImageContents::new(NONROOT);
    for (file, path) in spec.binaries {
        let binary = release.join(file);
        if !binary.is_file() {
            bail!(
                "{} is missing (build it with cargo build --release)",
                binary.display()
            );
        }
        contents.add_binary(path, &binary)?;
    }
    contents.add_ca_certificates()?;
    contents.add_nonroot_user();
    contents.entrypoint = vec![spec.binaries[0].1.to_owned()];
    contents.env = vec![
        "PATH=/".to_owned(),
        "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt".to_owned(),
    ];
    contents.labels = BTreeMap::from([
        (
            "org.opencontainers.image.title".to_owned(),
            spec.name.to_owned(),
        ),
        (
            "org.opencontainers.image.version".to_owned(),
            env!("CARGO_PKG_VERSION").to_owned(),
        ),
        (
            "org.opencontainers.image.revision".to_owned(),
            git_revision(root),
        ),
        (
            "org.opencontainers.image.source".to_owned(),
            "https://github.com/kube-netkit/kube-netkit".to_owned(),
        ),
        (
            "org.opencontainers.image.licenses".to_owned(),
            "Apache-2.0".to_owned(),
        ),
    ]);
    let reference = format!("{repository}/{}:{tag}", spec.name);
    write_image(spec.name, &reference, &contents, &images_dir(root))
}

/// Everything one single-layer image holds: files (path inside the image without the leading
/// `/` -> bytes and mode) and the runtime config.
#[derive(Debug, Clone, Default)]
pub struct ImageContents {
    pub files: BTreeMap<String, (Vec<u8>, u32)>,
    pub entrypoint: Vec<String>,
    /// Runs as `user:user`.
    pub user: u32,
    pub env: Vec<String>,
    pub labels: BTreeMap<String, String>,
}

impl ImageContents {
    /// No files yet; `PATH=/` because every binary sits at the root.
    pub fn new(user: u32) -> Self {
        Self {
            user,
            env: vec!["PATH=/".to_owned()],
            ..Self::default()
        }
    }

    /// The binary at `path` in the image, plus the shared libraries and loader it needs at the
    /// host paths `ldd` reports (so a glibc binary runs in an otherwise empty root).
    pub fn add_binary(&mut self, path: &str, binary: &Path) -> anyhow::Result<()> {
        let bytes =
            std::fs::read(binary).with_context(|| format!("reading {}", binary.display()))?;
        self.files
            .insert(path.trim_start_matches('/').to_owned(), (bytes, 0o755));
        for library in shared_libraries(binary)? {
            let bytes = std::fs::read(&library)
                .with_context(|| format!("reading {}", library.display()))?;
            let path = library.to_string_lossy().trim_start_matches('/').to_owned();
            self.files.insert(path, (bytes, 0o755));
        }
        Ok(())
    }

    /// The host's CA bundle at /etc/ssl/certs/ca-certificates.crt.
    pub fn add_ca_certificates(&mut self) -> anyhow::Result<()> {
        let ca = std::fs::read("/etc/ssl/certs/ca-certificates.crt")
            .context("reading /etc/ssl/certs/ca-certificates.crt (install ca-certificates)")?;
        self.files
            .insert("etc/ssl/certs/ca-certificates.crt".to_owned(), (ca, 0o644));
        Ok(())
    }

    /// /etc/passwd and /etc/group naming root and the non-root user 65532.
    pub fn add_nonroot_user(&mut self) {
        self.files.insert(
            "etc/passwd".to_owned(),
            (
                format!("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:{NONROOT}:{NONROOT}:nonroot:/home/nonroot:/sbin/nologin\n").into_bytes(),
                0o644,
            ),
        );
        self.files.insert(
            "etc/group".to_owned(),
            (
                format!("root:x:0:\nnonroot:x:{NONROOT}:\n").into_bytes(),
                0o644,
            ),
        );
    }
}

/// Writes `contents` as the OCI layout `<out_dir>/<name>/` and the tarball `<out_dir>/<name>.tar`
/// (an OCI layout plus the classic `manifest.json`, so both `docker load` and
/// `ctr images import` read it), tagged `reference`. Deterministic: the same contents and
/// `SOURCE_DATE_EPOCH` give the same digests.
pub fn write_image(
    name: &str,
    reference: &str,
    contents: &ImageContents,
    out_dir: &Path,
) -> anyhow::Result<Built> {
    let mtime = source_date_epoch();
    let layer = layer_tar(&contents.files, mtime)?;
    let layer_digest = sha256(&layer);

    let labels = serde_json::to_value(&contents.labels)?;
    let created = format_epoch(mtime);
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": {
            "User": format!("{0}:{0}", contents.user),
            "Entrypoint": contents.entrypoint,
            "Env": contents.env,
            "WorkingDir": "/",
            "Labels": labels,
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_digest}")]},
        "history": [{"created": created, "created_by": "cargo xtask image"}],
    });
    let config_bytes = serde_json::to_vec(&config)?;
    let config_digest = sha256(&config_bytes);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": format!("sha256:{config_digest}"),
            "size": config_bytes.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": format!("sha256:{layer_digest}"),
            "size": layer.len(),
        }],
        "annotations": labels,
    });
    let manifest_bytes = serde_json::to_vec(&manifest)?;
    let manifest_digest = sha256(&manifest_bytes);
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{manifest_digest}"),
            "size": manifest_bytes.len(),
            "annotations": {
                "org.opencontainers.image.ref.name": reference_tag(reference),
                "io.containerd.image.name": reference,
            },
        }],
    });
    let docker_manifest = serde_json::json!([{
        "Config": format!("blobs/sha256/{config_digest}"),
        "RepoTags": [reference],
        "Layers": [format!("blobs/sha256/{layer_digest}")],
    }]);

    let mut entries: BTreeMap<String, (Vec<u8>, u32)> = BTreeMap::new();
    entries.insert(
        "oci-layout".to_owned(),
        (br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(), 0o644),
    );
    entries.insert(
        "index.json".to_owned(),
        (serde_json::to_vec(&index)?, 0o644),
    );
    entries.insert(format!("blobs/sha256/{layer_digest}"), (layer, 0o644));
    entries.insert(
        format!("blobs/sha256/{config_digest}"),
        (config_bytes, 0o644),
    );
    entries.insert(
        format!("blobs/sha256/{manifest_digest}"),
        (manifest_bytes, 0o644),
    );

    let layout = out_dir.join(name);
    if layout.exists() {
        std::fs::remove_dir_all(&layout)
            .with_context(|| format!("removing {}", layout.display()))?;
    }
    for (path, (bytes, _)) in &entries {
        let file = layout.join(path);
        if let Some(parent) = file.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(&file, bytes).with_context(|| format!("writing {}", file.display()))?;
    }
    entries.insert(
        "manifest.json".to_owned(),
        (serde_json::to_vec(&docker_manifest)?, 0o644),
    );
    let tarball = out_dir.join(format!("{name}.tar"));
    // Written aside and renamed, so a reader never sees half a tarball.
    let partial = out_dir.join(format!("{name}.tar.partial"));
    std::fs::write(&partial, layer_tar(&entries, mtime)?)
        .with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, &tarball)
        .with_context(|| format!("renaming to {}", tarball.display()))?;
    Ok(Built {
        name: name.to_owned(),
        reference: reference.to_owned(),
        manifest_digest: format!("sha256:{manifest_digest}"),
        layout,
        tarball,
    })
}

/// The tag of `registry/path:tag` (a `:` inside the registry's host:port is not one); `latest`
/// when there is none, as container tools assume.
fn reference_tag(reference: &str) -> &str {
    let last = reference.rsplit('/').next().unwrap_or(reference);
    last.rsplit_once(':').map_or("latest", |(_, tag)| tag)
}

/// A tar of `files` (parents created as directories), deterministic for the same input.
fn layer_tar(files: &BTreeMap<String, (Vec<u8>, u32)>, mtime: u64) -> anyhow::Result<Vec<u8>> {
    let mut dirs: BTreeMap<String, ()> = BTreeMap::new();
    for path in files.keys() {
        let mut parent = Path::new(path).parent();
        while let Some(dir) = parent.filter(|d| !d.as_os_str().is_empty()) {
            dirs.insert(format!("{}/", dir.display()), ());
            parent = dir.parent();
        }
    }
    let mut builder = tar::Builder::new(Vec::new());
    for dir in dirs.keys() {
        let mut h = header(0, 0o755, tar::EntryType::Directory, mtime);
        builder.append_data(&mut h, dir, std::io::empty())?;
    }
    for (path, (bytes, mode)) in files {
        let mut h = header(bytes.len() as u64, *mode, tar::EntryType::Regular, mtime);
        builder.append_data(&mut h, path, bytes.as_slice())?;
    }
    Ok(builder.into_inner()?)
}

/// A root-owned entry header with a fixed mtime.
fn header(size: u64, mode: u32, kind: tar::EntryType, mtime: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(mtime);
    h
}

/// The shared libraries (and dynamic loader) `binary` needs, resolved to real files.
fn shared_libraries(binary: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let output = Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&output.stdout);
    if text.contains("not a dynamic executable") || text.contains("statically linked") {
        return Ok(Vec::new());
    }
    let mut libraries = Vec::new();
    for line in text.lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(path) = path.filter(|p| p.starts_with('/')) {
            libraries.push(PathBuf::from(path));
        }
    }
    Ok(libraries)
}

/// Where `cargo xtask image` writes the release images: `<target>/images`.
pub fn images_dir(root: &Path) -> PathBuf {
    target_dir(root).join("images")
}

fn source_date_epoch() -> u64 {
    std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn format_epoch(seconds: u64) -> String {
    k8s_openapi::jiff::Timestamp::from_second(i64::try_from(seconds).unwrap_or(0))
        .map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".to_owned())
}

fn git_revision(root: &Path) -> String {
    Command::new("git")
        .current_dir(root)
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned())
}

fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Checks built images the way a user would meet them: unpack with umoci, read the runtime
/// config (user 65532, entrypoint), run each binary inside the unpacked root filesystem with
/// `--version` and `--help`, and rebuild to prove the digest is reproducible.
pub fn verify(args: &Args) -> anyhow::Result<()> {
    let first = run(args)?;
    let again = run(&Args {
        skip_build: true,
        ..args.clone()
    })?;
    for (a, b) in first.iter().zip(&again) {
        if a.manifest_digest != b.manifest_digest {
            bail!(
                "{} is not reproducible: {} then {}",
                a.name,
                a.manifest_digest,
                b.manifest_digest
            );
        }
    }
    let umoci =
        which("umoci").context("umoci is needed to verify images (apt-get install umoci)")?;
    let chroot = which("chroot").context("chroot (coreutils) is needed to verify images")?;
    for image in &first {
        let spec = IMAGES
            .iter()
            .find(|s| s.name == image.name)
            .context("unknown image")?;
        let bundle = tempfile::tempdir()?;
        let bundle_dir = bundle.path().join("bundle");
        let tag = image.reference.rsplit(':').next().unwrap_or_default();
        let status = Command::new(&umoci)
            .arg("unpack")
            .arg("--image")
            .arg(format!("{}:{tag}", image.layout.display()))
            .arg(&bundle_dir)
            .status()?;
        if !status.success() {
            bail!("umoci unpack of {} failed", image.name);
        }
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(bundle_dir.join("config.json"))?)?;
        let user = &config["process"]["user"];
        if user["uid"] != NONROOT || user["gid"] != NONROOT {
            bail!("{}: runs as {user}, not {NONROOT}", image.name);
        }
        let entrypoint = config["process"]["args"][0].as_str().unwrap_or_default();
        if entrypoint != spec.binaries[0].1 {
            bail!("{}: entrypoint {entrypoint:?}", image.name);
        }
        let rootfs = bundle_dir.join("rootfs");
        for (_, path) in spec.binaries {
            for flag in ["--version", "--help"] {
                // Nothing from the host but the kernel: an empty environment and the image's root.
                let output = Command::new(&chroot)
                    .arg(&rootfs)
                    .arg(path)
                    .arg(flag)
                    .env_clear()
                    .output()
                    .context("running chroot")?;
                if !output.status.success() {
                    bail!(
                        "{}: {path} {flag} failed inside the image: {}",
                        image.name,
                        String::from_utf8_lossy(&output.stderr)
                    );
                }
            }
        }
        println!(
            "verified {} ({}): user {NONROOT}, entrypoint {entrypoint}, binaries run",
            image.reference, image.manifest_digest
        );
    }
    Ok(())
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_string_lossy()
        .split(':')
        .map(|dir| Path::new(dir).join(name))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn reference_tag_skips_a_registry_port() {
        assert_eq!(reference_tag("localhost/kube-netkit/pause:1"), "1");
        assert_eq!(reference_tag("localhost:5000/kube-netkit/pause:v2"), "v2");
        assert_eq!(reference_tag("localhost:5000/kube-netkit/pause"), "latest");
    }

    #[test]
    fn write_image_is_deterministic_and_loadable() {
        let mut contents = ImageContents::new(NONROOT);
        contents
            .files
            .insert("bin/tool".to_owned(), (b"#!/bin/true\n".to_vec(), 0o755));
        contents.add_nonroot_user();
        contents.entrypoint = vec!["/bin/tool".to_owned(), "serve".to_owned()];
        let dir = tempfile::tempdir().expect("tempdir");
        let first = write_image("tool", "localhost/test/tool:7", &contents, dir.path())
            .expect("first write");
        let tarball = std::fs::read(&first.tarball).expect("tarball");
        let again = write_image("tool", "localhost/test/tool:7", &contents, dir.path())
            .expect("second write");
        assert_eq!(first.manifest_digest, again.manifest_digest);
        assert_eq!(tarball, std::fs::read(&again.tarball).expect("tarball"));

        // What docker load and ctr import read: manifest.json naming the config and the layer.
        let mut archive = tar::Archive::new(tarball.as_slice());
        let mut files = BTreeMap::new();
        for entry in archive.entries().expect("entries") {
            let mut entry = entry.expect("entry");
            let path = entry.path().expect("path").to_string_lossy().into_owned();
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut bytes).expect("read");
            files.insert(path, bytes);
        }
        let manifest: serde_json::Value =
            serde_json::from_slice(&files["manifest.json"]).expect("manifest.json");
        assert_eq!(manifest[0]["RepoTags"][0], "localhost/test/tool:7");
        let config_path = manifest[0]["Config"].as_str().expect("Config");
        let config: serde_json::Value =
            serde_json::from_slice(&files[config_path]).expect("config");
        assert_eq!(config["config"]["User"], "65532:65532");
        assert_eq!(
            config["config"]["Entrypoint"],
            serde_json::json!(["/bin/tool", "serve"])
        );
        let layer_path = manifest[0]["Layers"][0].as_str().expect("layer");
        let digest = format!("blobs/sha256/{}", sha256(&files[layer_path]));
        assert_eq!(layer_path, digest, "blobs are named by their digest");
        let index: serde_json::Value =
            serde_json::from_slice(&files["index.json"]).expect("index.json");
        assert_eq!(
            index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"],
            "7"
        );
        assert_eq!(
            index["manifests"][0]["digest"].as_str(),
            Some(first.manifest_digest.as_str())
        );
    }
}
