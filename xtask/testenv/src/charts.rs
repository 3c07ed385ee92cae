//! `cargo xtask charts --package`: the Helm chart repository users add with `helm repo add`.
//!
//! Each chart is first checked against its crate: `version` and `appVersion` are the crate's
//! version, `home` lies under the crate's homepage (or repository), `sources` names the
//! workspace repository and `maintainers` is set. Then `helm package` writes `<name>-<version>.tgz` into
//! `<target>/charts/` (`CARGO_TARGET_DIR` respected) and `helm repo index` writes its
//! `index.yaml`. [`Server`] serves such a folder over HTTP on loopback, so `cargo xtask e2e` and
//! `cargo xtask demo` install the charts from the repository, as users do, never from the source
//! folders.

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context as _, bail};

/// The charts of the workspace, each named after its crate and kept in `<crate>/chart`.
pub const CHARTS: [&str; 3] = ["steward-tcp-proxy", "pod-proxier", "rstream-operator"];

/// The name the e2e and the demo give the repository in `helm repo add`.
pub const REPO_NAME: &str = "kube-netkit";

/// One packaged chart.
#[derive(Debug, Clone)]
pub struct Packaged {
    /// The chart's name.
    pub name: String,
    /// Its version (Chart.yaml).
    pub version: String,
    /// The `helm package` archive.
    pub archive: PathBuf,
}

/// `<target>/charts`, the repository's folder.
pub fn repo_dir() -> PathBuf {
    crate::workspace::target_dir(&crate::workspace::root()).join("charts")
}

/// What `cargo metadata` says of one crate.
#[derive(Debug, serde::Deserialize)]
struct CrateInfo {
    name: String,
    version: String,
    repository: Option<String>,
    homepage: Option<String>,
}

#[derive(Debug, serde::Deserialize)]
struct Metadata {
    packages: Vec<CrateInfo>,
}

fn crate_infos() -> anyhow::Result<Vec<CrateInfo>> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .current_dir(crate::workspace::root())
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!("cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    }
    let metadata: Metadata = serde_json::from_slice(&out.stdout)?;
    Ok(metadata.packages)
}

/// The Chart.yaml fields checked against the crate.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ChartMeta {
    name: String,
    version: String,
    app_version: Option<String>,
    home: Option<String>,
    #[serde(default)]
    sources: Vec<String>,
    #[serde(default)]
    maintainers: Vec<Maintainer>,
}

#[derive(Debug, serde::Deserialize)]
struct Maintainer {
    name: Option<String>,
}

/// Every way `chart` (its Chart.yaml) disagrees with `krate`; empty when it agrees.
fn chart_problems(chart: &ChartMeta, krate: &CrateInfo) -> Vec<String> {
    let mut problems = Vec::new();
    if chart.name != krate.name {
        problems.push(format!(
            "name {} is not the crate's {}",
            chart.name, krate.name
        ));
    }
    if chart.version != krate.version {
        problems.push(format!(
            "version {} is not the crate's {}",
            chart.version, krate.version
        ));
    }
    if chart.app_version.as_deref() != Some(krate.version.as_str()) {
        problems.push(format!(
            "appVersion {:?} is not the crate's {}",
            chart.app_version, krate.version
        ));
    }
    // A binary crate may name only its repository.
    let homepage = krate.homepage.as_ref().or(krate.repository.as_ref());
    match (&chart.home, homepage) {
        (Some(home), Some(homepage)) if home.starts_with(homepage.as_str()) => {}
        (home, homepage) => problems.push(format!(
            "home {home:?} does not lie under the crate's homepage {homepage:?}"
        )),
    }
    match &krate.repository {
        Some(repository) if chart.sources.contains(repository) => {}
        repository => problems.push(format!(
            "sources {:?} do not name the crate's repository {repository:?}",
            chart.sources
        )),
    }
    if chart.maintainers.is_empty() || chart.maintainers.iter().any(|m| m.name.is_none()) {
        problems.push("maintainers must list at least one, each with a name".to_owned());
    }
    problems
}

/// Checks every chart against its crate, packages them into [`repo_dir`] (emptied first) and
/// indexes the folder.
pub fn package(helm: &Path) -> anyhow::Result<Vec<Packaged>> {
    let out = repo_dir();
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("emptying {}", out.display()))?;
    }
    std::fs::create_dir_all(&out)?;
    let crates = crate_infos()?;
    let root = crate::workspace::root();
    let mut packaged = Vec::new();
    for name in CHARTS {
        let dir = root.join(name).join("chart");
        let krate = crates
            .iter()
            .find(|c| c.name == name)
            .with_context(|| format!("no crate {name} in the workspace"))?;
        let chart: ChartMeta = serde_yaml_ng::from_str(
            &std::fs::read_to_string(dir.join("Chart.yaml"))
                .with_context(|| format!("reading {name}'s Chart.yaml"))?,
        )
        .with_context(|| format!("parsing {name}'s Chart.yaml"))?;
        let problems = chart_problems(&chart, krate);
        if !problems.is_empty() {
            bail!("{name}/chart/Chart.yaml: {}", problems.join("; "));
        }
        packaged.push(package_dir(helm, &dir, &out)?);
    }
    index(helm, &out)?;
    Ok(packaged)
}

/// `helm package` of the chart in `dir` into `out`.
pub fn package_dir(helm: &Path, dir: &Path, out: &Path) -> anyhow::Result<Packaged> {
    let chart: ChartMeta =
        serde_yaml_ng::from_str(&std::fs::read_to_string(dir.join("Chart.yaml"))?)?;
    let output = Command::new(helm)
        .arg("package")
        .arg(dir)
        .arg("--destination")
        .arg(out)
        .output()
        .context("running helm package")?;
    if !output.status.success() {
        bail!(
            "helm package {}: {}{}",
            dir.display(),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let archive = out.join(format!("{}-{}.tgz", chart.name, chart.version));
    if !archive.is_file() {
        bail!("helm package did not write {}", archive.display());
    }
    Ok(Packaged {
        name: chart.name,
        version: chart.version,
        archive,
    })
}

/// `helm repo index` of `dir` (relative URLs: the archives are served beside index.yaml).
pub fn index(helm: &Path, dir: &Path) -> anyhow::Result<()> {
    let output = Command::new(helm)
        .args(["repo", "index"])
        .arg(dir)
        .output()
        .context("running helm repo index")?;
    if !output.status.success() {
        bail!(
            "helm repo index {}: {}",
            dir.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// `cargo xtask charts --package`.
pub fn run(helm: &Path) -> anyhow::Result<()> {
    let packaged = package(helm)?;
    for chart in &packaged {
        let size = std::fs::metadata(&chart.archive)?.len();
        println!(
            "ok   {} {} (= the crate's version): {} ({size} bytes)",
            chart.name,
            chart.version,
            chart.archive.display()
        );
    }
    println!("wrote {}", repo_dir().join("index.yaml").display());
    Ok(())
}

/// A read-only HTTP server on loopback for the files of one folder (a chart repository: its
/// `index.yaml` and archives). It stops when dropped.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Serves `dir` on a free loopback port until dropped.
    pub fn start(dir: &Path) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the chart server")?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let dir = dir.to_path_buf();
        let stopping = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stopping.load(Ordering::SeqCst) {
                    break;
                }
                if let Ok(stream) = stream
                    && let Err(err) = serve(stream, &dir)
                {
                    eprintln!("chart server: {err:#}");
                }
            }
        });
        Ok(Self {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The URL to give `helm repo add`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees the flag.
        let _ = TcpStream::connect(self.addr);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Answers one GET with a file of `dir` (a plain name: no folders, no `..`).
fn serve(stream: TcpStream, dir: &Path) -> anyhow::Result<()> {
    stream.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    // The headers are read and ignored.
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" || line == "\n" {
            break;
        }
    }
    let mut parts = request_line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let name = target
        .split('?')
        .next()
        .unwrap_or("")
        .trim_start_matches('/');
    let file = (method == "GET" && !name.is_empty() && !name.contains('/') && !name.contains(".."))
        .then(|| std::fs::read(dir.join(name)).ok())
        .flatten();
    let mut stream = stream;
    match file {
        Some(body) => {
            let kind = if name.ends_with(".yaml") {
                "application/x-yaml"
            } else {
                "application/gzip"
            };
            write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )?;
            stream.write_all(&body)?;
        }
        None => {
            let body = format!("no {name}\n");
            write!(
                stream,
                "HTTP/1.1 404 Not Found\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )?;
        }
    }
    Ok(stream.flush()?)
}

/// A CRD's generated YAML as a chart template: rendered only with `crds.install`, labelled with
/// the chart's `labels` template, and kept on uninstall with `crds.keep`. Everything from `spec:`
/// on is the generated YAML byte for byte.
pub fn chart_template(yaml: &str, labels: &str) -> anyhow::Result<String> {
    let head =
        "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata:\n  name: ";
    let rest = yaml
        .strip_prefix(head)
        .context("the generated CRD does not start with apiVersion, kind and metadata.name")?;
    let (name, spec) = rest
        .split_once('\n')
        .context("the generated CRD ends after its name")?;
    if !spec.starts_with("spec:\n") {
        bail!("the generated CRD {name} has metadata besides its name; teach chart_template");
    }
    if yaml.contains("{{") {
        bail!("the generated CRD {name} holds `{{{{`, which Helm would read as a template");
    }
    Ok(TEMPLATE
        .replace("NAME", name)
        .replace("LABELS", labels)
        .replace("SPEC", spec))
}

/// [`chart_template`]'s frame; `SPEC` ends with a newline, which `{{- end }}` trims.
const TEMPLATE: &str = r#"{{- /* Generated by `cargo xtask crds` from the Rust types: do not edit. */}}
{{- if .Values.crds.install }}
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: NAME
  labels:
    {{- include "LABELS" . | nindent 4 }}
  {{- if .Values.crds.keep }}
  annotations:
    # helm uninstall leaves the CRD, and so every object of this kind.
    helm.sh/resource-policy: keep
  {{- end }}
SPEC{{- end }}
"#;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn krate() -> CrateInfo {
        CrateInfo {
            name: "pod-proxier".to_owned(),
            version: "0.2.0".to_owned(),
            repository: Some("https://example.com/repo".to_owned()),
            homepage: Some("https://example.com/repo".to_owned()),
        }
    }

    fn chart(version: &str, app_version: &str) -> ChartMeta {
        ChartMeta {
            name: "pod-proxier".to_owned(),
            version: version.to_owned(),
            app_version: Some(app_version.to_owned()),
            home: Some("https://example.com/repo/tree/main/pod-proxier".to_owned()),
            sources: vec!["https://example.com/repo".to_owned()],
            maintainers: vec![Maintainer {
                name: Some("devs".to_owned()),
            }],
        }
    }

    #[test]
    fn chart_must_carry_the_crate_version() {
        assert!(chart_problems(&chart("0.2.0", "0.2.0"), &krate()).is_empty());
        let stale = chart_problems(&chart("0.1.0", "0.1.0"), &krate());
        assert_eq!(stale.len(), 2, "{stale:?}");
        assert!(stale[0].contains("version 0.1.0 is not the crate's 0.2.0"));
        assert!(stale[1].contains("appVersion"));
    }

    #[test]
    fn chart_must_name_home_sources_and_maintainers() {
        let mut bare = chart("0.2.0", "0.2.0");
        bare.home = None;
        bare.sources.clear();
        bare.maintainers.clear();
        let problems = chart_problems(&bare, &krate());
        assert_eq!(problems.len(), 3, "{problems:?}");
    }

    #[test]
    fn server_serves_only_plain_names_of_its_folder() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("index.yaml"), "apiVersion: v1\n").unwrap();
        let server = Server::start(dir.path()).unwrap();
        let get = |path: &str| {
            let mut stream = TcpStream::connect(server.addr).unwrap();
            write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut answer = String::new();
            std::io::Read::read_to_string(&mut stream, &mut answer).unwrap();
            answer
        };
        let index = get("/index.yaml");
        assert!(index.starts_with("HTTP/1.1 200"), "{index}");
        assert!(index.ends_with("apiVersion: v1\n"), "{index}");
        assert!(get("/../Cargo.toml").starts_with("HTTP/1.1 404"));
        assert!(get("/missing.tgz").starts_with("HTTP/1.1 404"));
    }
}
