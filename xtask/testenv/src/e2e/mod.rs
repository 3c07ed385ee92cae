//! `cargo xtask e2e`: the charts on a real node, as users run them.
//!
//! Builds the release images, starts the test control plane with its node (the API server with
//! `--endpoint-reconciler-type=none`, as a hosted control plane runs it), imports the images into
//! the node's containerd, packages the charts into the chart repository (`cargo xtask charts
//! --package`), serves it on loopback and `helm repo add`s it ([`ChartRepo`]), installs each chart
//! from that repository with Helm into a namespace where Pod Security
//! `restricted` is enforced, runs the chart's scenarios and writes `target/e2e/report.json` and
//! `target/e2e/report.md`: per chart the install-to-Ready time, each scenario with its result and
//! timing, and every container's restart count.
//!
//! One file per chart: [`steward`], [`pod_proxier`], [`rstream_operator`]; [`partition`] cuts the
//! node off from the API server during pod-proxier's run. Nothing here writes a
//! status that a kubelet or a controller would write. Before steward runs, the test harness
//! points `default/kubernetes` at the API server once, as the operator of a hosted control plane
//! does (the API server's own reconciler is off); steward then takes the objects over.
//!
//! `cargo xtask demo` runs on the same cluster: `ensure_tools` (xtask), [`start_cluster`], [`Env::new`],
//! each chart's `install` and the steps the demo shows are shared from here, so they exist once.

pub mod partition;
pub mod pod_proxier;
pub mod pod_proxier_api;
mod report;
pub mod rollout;
pub mod rstream_operator;
pub mod steward;

pub use report::{ChartReport, FAILURE_PREFIX, Restarts};
use report::{Report, failure_lines, markdown};

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::ControlPlane;
use crate::node::{self, TESTBOX_IMAGE, check};
use anyhow::{Context as _, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, PodSpec};
use kube::api::{Api, ListParams};

use crate::charts::{Packaged, REPO_NAME, Server};
use crate::images::Built;

/// What dashboards look for in every binary's `/metrics`: the process metrics (the build info
/// is the binary's own, `<binary>_build_info`).
const PROCESS_FAMILIES: [&str; 3] = [
    "process_cpu_seconds",
    "process_resident_memory_bytes",
    "process_open_fds",
];
/// Names the binaries used before they took controller-runtime's; they must never come back.
const RETIRED_FAMILIES: [&str; 3] = ["reconcile", "reconcile_duration_seconds", "leader"];

/// Scrapes `addr`'s `/metrics` (retrying for 30 s) and records a scenario: the exposition has
/// `<binary>_build_info`, the process metrics and every family of `required` (`# TYPE` names,
/// counters without `_total`), and none of the retired names.
async fn record_metric_names(
    report: &mut ChartReport,
    name: &str,
    scrape: &Scrape,
    binary: &str,
    required: &[&str],
) {
    let addr = scrape.addr();
    let started = Instant::now();
    let build_info = format!("{}_build_info", binary.replace('-', "_"));
    let wanted: Vec<&str> = std::iter::once(build_info.as_str())
        .chain(PROCESS_FAMILIES)
        .chain(required.iter().copied())
        .collect();
    // A family shows once it has a sample, which may lag the traffic that makes it.
    let (metrics, families, missing) = loop {
        let metrics = scrape.metrics().await;
        let families: Vec<String> = metrics
            .as_ref()
            .map(|m| {
                m.lines()
                    .filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let missing: Vec<&str> = (wanted.iter().copied())
            .filter(|family| !families.iter().any(|f| f == family))
            .collect();
        if (metrics.is_ok() && missing.is_empty()) || started.elapsed() > Duration::from_secs(30) {
            break (metrics, families, missing);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let retired: Vec<&str> = RETIRED_FAMILIES
        .into_iter()
        .filter(|family| families.iter().any(|f| f == family))
        .collect();
    let controller_runtime: Vec<&String> = (families.iter())
        .filter(|f| f.starts_with("controller_runtime_") || f.starts_with("leader_election_"))
        .collect();
    report.record(
        name,
        metrics.is_ok() && missing.is_empty() && retired.is_empty(),
        started,
        match &metrics {
            Ok(_) => format!(
                "{} metric families from {addr}; missing {missing:?}; retired names {retired:?}; \
                 controller-runtime's {controller_runtime:?}",
                families.len()
            ),
            Err(e) => format!("{addr}: {e}"),
        },
    );
}

/// How a scenario reads a binary's `/metrics`.
pub enum Scrape {
    /// Plain HTTP, as anyone (the chart's metrics are open).
    Open(SocketAddr),
    /// HTTPS with a ServiceAccount's token (the chart's secure default).
    Secure {
        /// The HTTPS address.
        addr: SocketAddr,
        /// The bearer token.
        token: String,
    },
}

impl Scrape {
    fn addr(&self) -> SocketAddr {
        match self {
            Scrape::Open(addr) | Scrape::Secure { addr, .. } => *addr,
        }
    }

    /// The exposition of a 200 answer, else why there is none.
    pub async fn metrics(&self) -> Result<String, String> {
        match self {
            Scrape::Open(addr) => check::http_get(*addr, "/metrics").await,
            Scrape::Secure { addr, token } => match https_get(*addr, "/metrics", Some(token)).await
            {
                Ok((200, body)) => Ok(body),
                Ok((status, body)) => Err(format!("answer {status}: {}", body.trim())),
                Err(e) => Err(format!("{e:#}")),
            },
        }
    }
}

/// One `GET path` over HTTPS with an optional bearer token: (status, body). Any server
/// certificate is accepted: a secure metrics server's is self-signed, made at each start (the
/// claim checked through this is who may read, not who serves).
pub async fn https_get(
    addr: SocketAddr,
    path: &str,
    token: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n{auth}\r\n");
    // rustls on a blocking socket (xtask has no tokio-rustls), each read and write bounded.
    let exchange = move || -> anyhow::Result<String> {
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(std::sync::Arc::new(
                proxy_core::tls::AcceptAnyCert::new(provider),
            ))
            .with_no_client_auth();
        let name = rustls::pki_types::ServerName::try_from("metrics")?;
        let limit = Duration::from_secs(10);
        tls_exchange(addr, &request, limit, std::sync::Arc::new(config), name)
    };
    let text = tokio::task::spawn_blocking(exchange)
        .await
        .context("the TLS request's thread")??;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = (head.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    Ok((status, body.to_owned()))
}

/// A token (valid an hour) of the ServiceAccount `ns/account`.
pub async fn token(env: &Env<'_>, ns: &str, account: &str) -> anyhow::Result<String> {
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(env.plane.client().await?, ns);
    let request: k8s_openapi::api::authentication::v1::TokenRequest =
        serde_json::from_value(serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": { "audiences": [], "expirationSeconds": 3600 },
        }))?;
    let answer = accounts
        .create_token_request(account, &kube::api::PostParams::default(), &request)
        .await?;
    answer.status.and_then(|s| s.token).context("no token")
}

/// A ServiceAccount `ns/account` bound (ClusterRoleBinding) to the chart's metrics-reader
/// ClusterRole `role`, as a user binds Prometheus's to read a secure `/metrics`.
pub async fn bind_metrics_reader(
    env: &Env<'_>,
    ns: &str,
    account: &str,
    role: &str,
) -> anyhow::Result<()> {
    apply_objects(
        env,
        [
            serde_json::json!({ "apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": { "name": account, "namespace": ns } }),
            serde_json::json!({ "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": { "name": format!("e2e-{ns}-{account}") },
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                             "name": role },
                "subjects": [{ "kind": "ServiceAccount", "name": account, "namespace": ns }] }),
        ],
    )
    .await
}

/// `request` over TLS (`config`, verifying the server as `name`) on a blocking socket whose
/// reads and writes each time out after `limit`; the whole answer.
pub fn tls_exchange(
    addr: SocketAddr,
    request: &str,
    limit: Duration,
    config: std::sync::Arc<rustls::ClientConfig>,
    name: rustls::pki_types::ServerName<'static>,
) -> anyhow::Result<String> {
    use std::io::{Read as _, Write as _};
    let tcp = std::net::TcpStream::connect_timeout(&addr, limit)?;
    tcp.set_read_timeout(Some(limit))?;
    tcp.set_write_timeout(Some(limit))?;
    let connection = rustls::ClientConnection::new(config, name)?;
    let mut stream = rustls::StreamOwned::new(connection, tcp);
    stream
        .write_all(request.as_bytes())
        .context("TLS handshake or request")?;
    let mut response = Vec::new();
    match stream.read_to_end(&mut response) {
        Ok(_) => {}
        // HTTP/1.0: the server may close without close_notify once it answered.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !response.is_empty() => {}
        Err(e) => return Err(e).context("reading the TLS answer"),
    }
    Ok(String::from_utf8_lossy(&response).into_owned())
}

/// Server-side applies each object (as the e2e field manager), namespaced or cluster-wide as
/// its metadata says.
pub async fn apply_objects(
    env: &Env<'_>,
    objects: impl IntoIterator<Item = serde_json::Value>,
) -> anyhow::Result<()> {
    let client = env.plane.client().await?;
    let params = kube::api::PatchParams::apply("e2e").force();
    for object in objects {
        let object: kube::api::DynamicObject = serde_json::from_value(object)?;
        let types = object.types.clone().context("no kind")?;
        let (group, version) = types
            .api_version
            .split_once('/')
            .unwrap_or(("", types.api_version.as_str()));
        let resource = kube::discovery::ApiResource {
            group: group.to_owned(),
            version: version.to_owned(),
            api_version: types.api_version.clone(),
            kind: types.kind.clone(),
            plural: format!("{}s", types.kind.to_ascii_lowercase()),
        };
        let name = object.metadata.name.clone().unwrap_or_default();
        let api: kube::Api<kube::api::DynamicObject> = match object.metadata.namespace.as_deref() {
            Some(ns) => kube::Api::namespaced_with(client.clone(), ns, &resource),
            None => kube::Api::all_with(client.clone(), &resource),
        };
        api.patch(&name, &params, &kube::api::Patch::Apply(&object))
            .await
            .with_context(|| format!("applying {} {name}", types.kind))?;
    }
    Ok(())
}

/// What every chart's run needs.
pub struct Env<'a> {
    /// The control plane with its node.
    pub plane: &'a ControlPlane,
    /// Helm's path.
    pub helm: PathBuf,
    /// `host:port` of the API server as Pods reach it.
    pub apiserver: String,
    /// Release image references by image name.
    pub images: Vec<(String, String)>,
    /// The packaged charts, served on loopback and added to Helm as [`REPO_NAME`].
    pub repo: ChartRepo,
}

/// The chart repository as users meet it: `cargo xtask charts --package`'s folder served over
/// HTTP on loopback and added with `helm repo add`, in a Helm home of its own (the user's Helm
/// configuration is neither read nor changed).
pub struct ChartRepo {
    /// Every chart, packaged.
    pub charts: Vec<Packaged>,
    /// The repository served on loopback.
    pub server: Server,
    home: tempfile::TempDir,
}

impl ChartRepo {
    /// Packages every chart, serves the repository and adds it to a fresh Helm home as
    /// [`REPO_NAME`].
    pub fn start(helm: &Path) -> anyhow::Result<Self> {
        let charts = crate::charts::package(helm)?;
        let server = Server::start(&crate::charts::repo_dir())?;
        let repo = Self {
            charts,
            server,
            home: tempfile::tempdir()?,
        };
        repo.add(helm, REPO_NAME, &repo.server.url())?;
        Ok(repo)
    }

    /// `helm repo add name url` in this repository's Helm home.
    pub fn add(&self, helm: &Path, name: &str, url: &str) -> anyhow::Result<()> {
        let mut cmd = std::process::Command::new(helm);
        self.helm_home(&mut cmd);
        let out = cmd
            .args(["repo", "add", name, url])
            .output()
            .context("running helm repo add")?;
        if !out.status.success() {
            bail!(
                "helm repo add {name} {url}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Points a helm command at this repository's Helm home.
    fn helm_home<C: HelmEnv>(&self, cmd: &mut C) {
        let home = self.home.path();
        cmd.set("HELM_CONFIG_HOME", home.join("config"));
        cmd.set("HELM_CACHE_HOME", home.join("cache"));
        cmd.set("HELM_DATA_HOME", home.join("data"));
    }
}

/// Environment setting on both kinds of Command.
trait HelmEnv {
    fn set(&mut self, key: &str, value: PathBuf);
}

impl HelmEnv for std::process::Command {
    fn set(&mut self, key: &str, value: PathBuf) {
        self.env(key, value);
    }
}

impl HelmEnv for tokio::process::Command {
    fn set(&mut self, key: &str, value: PathBuf) {
        self.env(key, value);
    }
}

/// How long the control plane and its node may take to start (a cold containerd and CoreDNS on a
/// busy small machine).
const CLUSTER_START_LIMIT: Duration = Duration::from_secs(240);

/// The control plane the charts run on, with its node: the API server without its endpoint
/// reconciler, as a hosted control plane runs it (the node points `default/kubernetes` at the
/// API server once; steward takes it over).
pub async fn start_cluster() -> anyhow::Result<ControlPlane> {
    ControlPlane::builder()
        .apiserver_arg("--endpoint-reconciler-type=none")
        .node()
        .start_timeout(CLUSTER_START_LIMIT)
        .start()
        .await
        .context("starting the control plane with its node")
}

impl<'a> Env<'a> {
    /// Imports the release images into the node's containerd, so kubelet runs them without a
    /// pull.
    pub fn new(plane: &'a ControlPlane, helm: PathBuf, built: &[Built]) -> anyhow::Result<Self> {
        let api_port = url_port(plane.server_url())?;
        let node = plane.node().context("the control plane has no node")?;
        for image in built {
            node.import_image(&image.tarball)
                .with_context(|| format!("importing {}", image.tarball.display()))?;
        }
        let repo = ChartRepo::start(&helm)?;
        Ok(Self {
            plane,
            helm,
            repo,
            apiserver: format!("{}:{api_port}", node::HOST_IP),
            images: built
                .iter()
                .map(|b| (b.name.clone(), b.reference.clone()))
                .collect(),
        })
    }
}

impl Env<'_> {
    /// The chart of `release` in the repository (each release is named after its chart):
    /// `(reference, version)` for `helm install/upgrade <reference> --version <version>`.
    pub fn chart(&self, release: &str) -> anyhow::Result<(String, String)> {
        let chart = self
            .repo
            .charts
            .iter()
            .find(|c| c.name == release)
            .with_context(|| format!("no chart {release} in the repository"))?;
        Ok((format!("{REPO_NAME}/{}", chart.name), chart.version.clone()))
    }

    fn image(&self, name: &str) -> anyhow::Result<(String, String)> {
        let reference = self
            .images
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, r)| r.clone())
            .with_context(|| format!("no image {name} was built"))?;
        let (repository, tag) = reference
            .rsplit_once(':')
            .with_context(|| format!("image reference {reference} has no tag"))?;
        Ok((repository.to_owned(), tag.to_owned()))
    }

    /// Runs helm with the plane's admin kubeconfig; fails with helm's output.
    pub async fn helm(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut cmd = tokio::process::Command::new(&self.helm);
        self.repo.helm_home(&mut cmd);
        let output = cmd
            .arg("--kubeconfig")
            .arg(self.plane.kubeconfig_path())
            .args(args)
            .output()
            .await
            .context("running helm")?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        if !output.status.success() {
            bail!("helm {}: {text}", args.join(" "));
        }
        Ok(text)
    }

    /// `helm upgrade --reuse-values` of `release` in `ns` to its chart in the repository, with
    /// `sets` as flag and value pairs (`("--set", "a=b")`); with `wait`, helm waits up to 120 s
    /// for the rollout. Returns how long helm took.
    pub async fn upgrade_reusing(
        &self,
        release: &str,
        ns: &str,
        sets: &[(&str, &str)],
        wait: bool,
    ) -> anyhow::Result<Duration> {
        let (chart, version) = self.chart(release)?;
        let mut args = vec![
            "upgrade",
            release,
            &chart,
            "--version",
            &version,
            "-n",
            ns,
            "--reuse-values",
        ];
        for (flag, value) in sets {
            args.extend([*flag, *value]);
        }
        if wait {
            args.extend(["--wait", "--timeout", "120s"]);
        }
        let started = Instant::now();
        self.helm(&args).await?;
        Ok(started.elapsed())
    }

    /// The Pod template of Deployment `name` in `ns`, as the API server has it now.
    pub async fn pod_template(&self, ns: &str, name: &str) -> anyhow::Result<PodSpec> {
        Api::<Deployment>::namespaced(self.plane.client().await?, ns)
            .get(name)
            .await?
            .spec
            .template
            .spec
            .with_context(|| format!("Deployment {ns}/{name} has no Pod template"))
    }

    /// `helm install <release>` of the chart from the repository into `ns` with `values` (each a
    /// `--set` argument) and `helm test` set to run the node's testbox image; returns helm's
    /// output, NOTES.txt included.
    pub async fn install_chart(
        &self,
        release: &str,
        ns: &str,
        values: &[String],
    ) -> anyhow::Result<String> {
        let (chart, version) = self.chart(release)?;
        let mut args = vec![
            "install",
            release,
            chart.as_str(),
            "--version",
            version.as_str(),
            "-n",
            ns,
        ];
        let tests = format!("tests.image={TESTBOX_IMAGE},tests.pullPolicy=Never");
        for value in [tests.as_str(), "tests.command={/testbox,get}"]
            .into_iter()
            .chain(values.iter().map(String::as_str))
        {
            args.extend(["--set", value]);
        }
        self.helm(&args).await
    }

    /// Creates a namespace labelled for Pod Security `restricted`.
    pub async fn restricted_namespace(&self, prefix: &str) -> anyhow::Result<String> {
        let ns = self.plane.create_namespace(prefix).await?;
        check::restrict_namespace(self.plane, &ns).await?;
        Ok(ns)
    }
}

/// How many scenarios a whole e2e run records: the charts' lists summed.
pub fn expected_scenario_count() -> u64 {
    let count = steward::expected_scenarios().len()
        + pod_proxier::expected_scenarios().len()
        + rstream_operator::expected_scenarios().len()
        + rollout::expected_scenarios().len();
    u64::try_from(count).unwrap_or(u64::MAX)
}

/// Runs the charts' scenarios (`charts`: only these releases, all three when empty) on a fresh
/// control plane with its node, with Helm at `helm` and the release images `built` (pod-proxier's
/// HAProxy sidecar among them when pod-proxier runs); writes `target/e2e/report.{json,md}`.
pub fn run(charts: &[String], helm: PathBuf, built: &[Built]) -> anyhow::Result<()> {
    let wall = Instant::now();
    let out_dir = crate::workspace::root().join("target/e2e");
    std::fs::create_dir_all(&out_dir)?;

    for chart in charts {
        if ![
            steward::RELEASE,
            pod_proxier::RELEASE,
            rstream_operator::RELEASE,
        ]
        .contains(&chart.as_str())
        {
            bail!("no chart {chart}: steward-tcp-proxy, pod-proxier or rstream-operator");
        }
    }
    let wanted = |release: &str| charts.is_empty() || charts.iter().any(|c| c == release);
    let runtime = tokio::runtime::Runtime::new()?;
    let report = runtime.block_on(async {
        let started = Instant::now();
        let plane = start_cluster().await?;
        let cluster_start = started.elapsed();
        println!("control plane and node ready in {cluster_start:.1?}");
        let env = Env::new(&plane, helm, built)?;
        let node = plane.node().context("the control plane has no node")?;
        let mut charts = Vec::new();
        if wanted(steward::RELEASE) {
            println!("steward-tcp-proxy:");
            let mut chart = steward::run(&env).await;
            chart.expect(&steward::expected_scenarios());
            charts.push(chart);
        }
        if wanted(pod_proxier::RELEASE) {
            println!("pod-proxier:");
            let mut chart = pod_proxier::run(&env).await;
            chart.expect(&pod_proxier::expected_scenarios());
            charts.push(chart);
        }
        if wanted(rstream_operator::RELEASE) {
            println!("rstream-operator:");
            let mut chart = rstream_operator::run(&env).await;
            chart.expect(&rstream_operator::expected_scenarios());
            charts.push(chart);
            println!("rstream-operator, agents rolling:");
            let mut chart = rollout::run(&env).await;
            chart.expect(&rollout::expected_scenarios());
            charts.push(chart);
        }
        if charts.iter().any(|c| !c.passed()) {
            eprintln!("{}", node.log_tails(15));
        }
        plane.stop();
        anyhow::Ok(Report {
            passed: charts.iter().all(ChartReport::passed),
            wall_ms: 0,
            cluster_start_ms: cluster_start.as_millis(),
            charts,
        })
    })?;
    let report = Report {
        wall_ms: wall.elapsed().as_millis(),
        ..report
    };
    std::fs::write(
        out_dir.join("report.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    let markdown = markdown(&report);
    std::fs::write(out_dir.join("report.md"), &markdown)?;
    println!("{markdown}");
    println!("wrote {}", out_dir.join("report.md").display());
    for line in failure_lines(&report) {
        println!("{line}");
    }
    // A closing line in the form CI reads: one count per scenario, plus a chart that failed
    // before its scenarios (its error) as one failure.
    let scenarios = report.charts.iter().flat_map(|c| &c.scenarios);
    let passed = scenarios.clone().filter(|s| s.ok).count();
    let failed = scenarios.filter(|s| !s.ok).count()
        + report.charts.iter().filter(|c| c.error.is_some()).count();
    if charts.is_empty() {
        println!("e2e: {passed} passed, {failed} failed");
    } else {
        // Not the line `cargo xtask test` reads: a partial run is not the e2e's result.
        println!(
            "e2e (only {}): {passed} passed, {failed} failed",
            charts.join(", ")
        );
    }
    if !report.passed {
        bail!("e2e failed; see {}", out_dir.join("report.md").display());
    }
    Ok(())
}

/// Every chart's [`helm_test_scenario`].
pub const HELM_TEST_SCENARIO: &str = "helm install prints NOTES.txt (what to check next); helm test (a restricted Pod through the Service) passes";

/// The chart as users meet it: `helm install` printed NOTES.txt (what to check next) and
/// `helm test` of `release` passes; `probe` names what the test Pod checks.
pub async fn helm_test_scenario(
    env: &Env<'_>,
    report: &mut ChartReport,
    release: &str,
    ns: &str,
    install_output: &str,
    probe: &str,
) {
    let started = Instant::now();
    let tested = env
        .helm(&["test", release, "-n", ns, "--timeout", "90s"])
        .await;
    let notes = install_output.contains("Check next");
    let detail = format!(
        "NOTES {}; helm test: {}",
        if notes { "printed" } else { "missing" },
        match &tested {
            Ok(t) => t
                .lines()
                .filter(|l| l.contains("TEST SUITE") || l.contains("Phase"))
                .collect::<Vec<_>>()
                .join(" "),
            Err(e) => format!("{e:#}").chars().take(300).collect(),
        }
    );
    report.record(
        HELM_TEST_SCENARIO,
        notes && tested.as_ref().is_ok_and(|t| t.contains("Succeeded")),
        started,
        format!("the test Pod GETs {probe}; {detail}"),
    );
}

/// A chart's report once its scenarios ended: their error, if any, and the restart counts its
/// watch saw. Unread restart counts are not zero restarts: they fail the chart too.
pub async fn finish_chart(
    mut report: ChartReport,
    outcome: anyhow::Result<()>,
    watch: Option<RestartWatch>,
) -> ChartReport {
    if let Err(err) = outcome {
        println!("  error: {err:#}");
        report.error = Some(format!("{err:#}"));
    }
    if let Some(watch) = watch {
        match watch.finish().await {
            Ok(restarts) => report.restarts = restarts,
            Err(err) => report
                .error
                .get_or_insert_with(String::new)
                .push_str(&format!(" restart counts: {err:#}")),
        }
    }
    report
}

/// Samples every container's restart count in some namespaces once a second from its start
/// until [`RestartWatch::finish`], keeping each container's highest count: a Pod that crash-looped
/// during an outage and was deleted later still counts. A failed sample is an error, never
/// zero restarts.
pub struct RestartWatch {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<anyhow::Result<Vec<Restarts>>>,
}

impl RestartWatch {
    /// Starts watching the containers of `namespaces` for restarts.
    pub async fn start(plane: &ControlPlane, namespaces: &[&str]) -> anyhow::Result<Self> {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let client = plane.client().await?;
        let namespaces: Vec<String> = namespaces.iter().map(|n| (*n).to_owned()).collect();
        let task = tokio::spawn(async move {
            let mut highest = Highest::new();
            loop {
                // One last sample after the stop, so the end state counts too.
                let last = *stopped.borrow();
                for ns in &namespaces {
                    let sample = restarts(&client, ns)
                        .await
                        .with_context(|| format!("sampling restart counts in {ns}"))?;
                    keep_highest(&mut highest, sample);
                }
                if last {
                    break;
                }
                // A dropped watch (its chart stopped by an error) stops sampling too.
                if let Ok(Err(_)) =
                    tokio::time::timeout(Duration::from_secs(1), stopped.changed()).await
                {
                    break;
                }
            }
            Ok(highest
                .into_iter()
                .map(|((pod, container), restarts)| Restarts {
                    pod,
                    container,
                    restarts,
                })
                .collect())
        });
        Ok(Self { stop, task })
    }

    /// Every container seen since the start, each with its highest restart count.
    pub async fn finish(self) -> anyhow::Result<Vec<Restarts>> {
        self.stop.send_replace(true);
        self.task.await.context("the restart sampler")?
    }
}

/// Each container's highest restart count so far, by Pod and container name.
type Highest = std::collections::BTreeMap<(String, String), i32>;

/// Folds one sample into `highest`: a container keeps its highest count, and a Pod no longer
/// listed keeps the count it had. A Pod deleted and replaced by its controller is a new name
/// starting at 0, not a restart; a crash loop raises the same container's count.
fn keep_highest(highest: &mut Highest, sample: Vec<Restarts>) {
    for r in sample {
        let count = highest.entry((r.pod, r.container)).or_insert(0);
        *count = (*count).max(r.restarts);
    }
}

/// Every container's restart count in `ns`.
async fn restarts(client: &kube::Client, ns: &str) -> anyhow::Result<Vec<Restarts>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut out = Vec::new();
    for pod in pods.list(&ListParams::default()).await? {
        let name = pod.metadata.name.clone().unwrap_or_default();
        for status in pod
            .status
            .and_then(|s| s.container_statuses)
            .unwrap_or_default()
        {
            out.push(Restarts {
                pod: name.clone(),
                container: status.name,
                restarts: status.restart_count,
            });
        }
    }
    Ok(out)
}

pub(crate) fn url_port(url: &str) -> anyhow::Result<u16> {
    url.rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .with_context(|| format!("no port in {url}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(counts: &[(&str, i32)]) -> Vec<Restarts> {
        counts
            .iter()
            .map(|(pod, restarts)| Restarts {
                pod: (*pod).to_owned(),
                container: "agent".to_owned(),
                restarts: *restarts,
            })
            .collect()
    }

    fn counts(highest: &Highest) -> Vec<(&str, i32)> {
        highest.iter().map(|((p, _), r)| (p.as_str(), *r)).collect()
    }

    #[test]
    fn a_replaced_pod_is_no_restart() {
        let mut highest = Highest::new();
        keep_highest(&mut highest, sample(&[("agent-a", 0)]));
        // agent-a killed; its Deployment's agent-b takes over.
        keep_highest(&mut highest, sample(&[("agent-b", 0)]));
        keep_highest(&mut highest, sample(&[("agent-b", 0)]));
        assert_eq!(counts(&highest), [("agent-a", 0), ("agent-b", 0)]);
    }

    #[test]
    fn a_crash_loop_counts_even_after_its_pod_is_gone() {
        let mut highest = Highest::new();
        keep_highest(&mut highest, sample(&[("agent-a", 0)]));
        keep_highest(&mut highest, sample(&[("agent-a", 2)]));
        // A later sample with a lower count (a replaced Pod of the same name) lowers nothing.
        keep_highest(&mut highest, sample(&[("agent-a", 0)]));
        keep_highest(&mut highest, sample(&[("agent-b", 1)]));
        assert_eq!(counts(&highest), [("agent-a", 2), ("agent-b", 1)]);
    }
}
