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

mod cluster;
pub mod node_loss;
pub mod partition;
pub mod pod_proxier;
pub mod pod_proxier_api;
mod report;
mod restarts;
pub mod rollout;
pub mod rstream_operator;
mod scrape;
pub mod steward;

pub use cluster::{ChartRepo, start_cluster, start_cluster_of};
pub use report::{ChartReport, FAILURE_PREFIX, Restarts};
use report::{Report, failure_lines, markdown};
pub use restarts::RestartWatch;
use scrape::record_metric_names;
pub use scrape::{Scrape, apply_objects, bind_metrics_reader, https_get, tls_exchange, token};

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::ControlPlane;
use crate::node::{self, TESTBOX_IMAGE, check};
use anyhow::{Context as _, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, PodSpec};
use kube::api::{Api, ListParams, LogParams};

use crate::charts::REPO_NAME;
use crate::images::Built;

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

impl<'a> Env<'a> {
    /// Imports the release images into every node's containerd, so kubelet runs them without a
    /// pull.
    pub fn new(plane: &'a ControlPlane, helm: PathBuf, built: &[Built]) -> anyhow::Result<Self> {
        let api_port = url_port(plane.server_url())?;
        if plane.nodes().is_empty() {
            bail!("the control plane has no node");
        }
        for node in plane.nodes() {
            for image in built {
                node.import_image(&image.tarball).with_context(|| {
                    format!("importing {} into {}", image.tarball.display(), node.name())
                })?;
            }
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
        // The test Pod asks through the Service, whose endpoints may reach kube-proxy after
        // the Pods turned Ready (a user's `helm test` right after an install meets the same).
        // `--set-string`: the schema wants the command's "60" as a string.
        let command = "tests.command={/testbox,get,--retry-for-seconds,60}";
        args.extend(["--set", tests.as_str(), "--set-string", command]);
        for value in values {
            args.extend(["--set", value.as_str()]);
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
        + rollout::expected_scenarios().len()
        + node_loss::expected_scenarios().len();
    u64::try_from(count).unwrap_or(u64::MAX)
}

/// Runs the charts' scenarios (`charts`: only these releases or the node-loss run, all four when
/// empty): the three charts on a fresh control plane with one node, then the node-loss run on a
/// cluster of two; with Helm at `helm` and the release images `built` (pod-proxier's
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
            node_loss::PHASE,
        ]
        .contains(&chart.as_str())
        {
            bail!(
                "no chart {chart}: steward-tcp-proxy, pod-proxier, rstream-operator or {} (the three on two nodes, one lost)",
                node_loss::PHASE
            );
        }
    }
    let wanted = |release: &str| charts.is_empty() || charts.iter().any(|c| c == release);
    let runtime = tokio::runtime::Runtime::new()?;
    let one_node = [
        steward::RELEASE,
        pod_proxier::RELEASE,
        rstream_operator::RELEASE,
    ]
    .iter()
    .any(|release| wanted(release));
    let report = runtime.block_on(async {
        let mut charts = Vec::new();
        let mut cluster_start = Duration::ZERO;
        if one_node {
            let started = Instant::now();
            let plane = start_cluster().await?;
            cluster_start = started.elapsed();
            println!("control plane and node ready in {cluster_start:.1?}");
            let env = Env::new(&plane, helm.clone(), built)?;
            one_node_charts(&env, &wanted, &mut charts).await;
            plane.stop();
        }
        if wanted(node_loss::PHASE) {
            // A cluster of its own: losing a node is the last thing a cluster sees.
            let started = Instant::now();
            let plane = start_cluster_of(2).await?;
            println!(
                "{}: control plane and 2 nodes ready in {:.1?}",
                node_loss::PHASE,
                started.elapsed()
            );
            let env = Env::new(&plane, helm, built)?;
            let mut chart = node_loss::run(&env).await;
            chart.expect(&node_loss::expected_scenarios());
            if !chart.passed() {
                for node in plane.nodes() {
                    eprintln!("--- {} ---\n{}", node.name(), node.log_tails(15));
                }
            }
            charts.push(chart);
            plane.stop();
        }
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

/// The three charts' scenarios on the one-node cluster of `env` (those `wanted`), each chart's
/// report appended to `charts`; the node's log tails printed when one failed.
async fn one_node_charts(
    env: &Env<'_>,
    wanted: &dyn Fn(&str) -> bool,
    charts: &mut Vec<ChartReport>,
) {
    if wanted(steward::RELEASE) {
        println!("steward-tcp-proxy:");
        let mut chart = steward::run(env).await;
        chart.expect(&steward::expected_scenarios());
        charts.push(chart);
    }
    if wanted(pod_proxier::RELEASE) {
        println!("pod-proxier:");
        let mut chart = pod_proxier::run(env).await;
        chart.expect(&pod_proxier::expected_scenarios());
        charts.push(chart);
    }
    if wanted(rstream_operator::RELEASE) {
        println!("rstream-operator:");
        let mut chart = rstream_operator::run(env).await;
        chart.expect(&rstream_operator::expected_scenarios());
        charts.push(chart);
        println!("rstream-operator, agents rolling:");
        let mut chart = rollout::run(env).await;
        chart.expect(&rollout::expected_scenarios());
        charts.push(chart);
    }
    if charts.iter().any(|c| !c.passed())
        && let Some(node) = env.plane.node()
    {
        eprintln!("{}", node.log_tails(15));
    }
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
        .helm(&["test", release, "-n", ns, "--timeout", "120s"])
        .await;
    let notes = install_output.contains("Check next");
    let phases = |text: &str| {
        text.lines()
            .filter(|l| l.contains("TEST SUITE") || l.contains("Phase"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let detail = format!(
        "NOTES {}; helm test: {}",
        if notes { "printed" } else { "missing" },
        match &tested {
            Ok(t) => phases(t),
            Err(e) => {
                // The phase and the Pod's last lines, not the release header before them.
                let text = format!("{e:#}");
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(8)..].join(" | ");
                format!(
                    "{}; test Pod log: {} ... helm: {}",
                    phases(&text),
                    test_pod_logs(env, ns).await,
                    tail
                )
                .chars()
                .take(2000)
                .collect()
            }
        }
    );
    report.record(
        HELM_TEST_SCENARIO,
        notes && tested.as_ref().is_ok_and(|t| t.contains("Succeeded")),
        started,
        format!("the test Pod GETs {probe}; {detail}"),
    );
}

/// The last log lines of the release's `helm test` Pods in `ns`: a failed one is kept (its
/// hook is deleted only on success), so its log says why it failed.
async fn test_pod_logs(env: &Env<'_>, ns: &str) -> String {
    let Ok(client) = env.plane.client().await else {
        return "no client".to_owned();
    };
    let pods = Api::<Pod>::namespaced(client, ns);
    let Ok(list) = pods.list(&ListParams::default()).await else {
        return "cannot list the Pods".to_owned();
    };
    let params = LogParams {
        tail_lines: Some(8),
        ..LogParams::default()
    };
    let mut logs = Vec::new();
    for pod in list.items {
        let name = pod.metadata.name.unwrap_or_default();
        if !name.contains("-test-") {
            continue;
        }
        let log = match pods.logs(&name, &params).await {
            Ok(log) => log.lines().collect::<Vec<_>>().join(" | "),
            Err(e) => format!("no log: {e}"),
        };
        logs.push(format!("{name}: {log}"));
    }
    if logs.is_empty() {
        "no test Pod left".to_owned()
    } else {
        logs.join("; ")
    }
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

pub(crate) fn url_port(url: &str) -> anyhow::Result<u16> {
    url.rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .with_context(|| format!("no port in {url}"))
}
