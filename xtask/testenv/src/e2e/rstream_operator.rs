//! rstream-operator on the node: the chart with its CRDs under Pod Security `restricted`, the
//! manager Ready by its own probe, its metrics through the chart's Service; the seed's Quick Start
//! against a LocalEngine run here on the host's end of the node link (a self-hosted engine with a
//! private CA, given to the agent by Secret reference, run as a process of its own by the
//! `local_engine` example and enforcing tokens): HTTP and TCP tunnels, token rotation (the old
//! token revoked in the engine), an agent Pod killed, the engine SIGKILLed under a live stream and
//! started again, deletion; NOTES.txt and `helm test`; a
//! `helm upgrade` to a next chart version whose CRD adds a field (served after the upgrade, the
//! existing object kept); an uninstall that leaves no Pod but keeps the CRDs and their objects
//! (`crds.keep`).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps,
};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use rstream_client::engine::{EngineIdentity, LocalEngine};
use rstream_client::tls::TlsOptions;
use rstream_operator::api::{RstreamConnection, RstreamTunnel};
use rstream_operator::names;
use serde_json::json;

use super::{ChartReport, Env, RestartWatch};
use crate::node::{self, check};

/// The chart's release name in the e2e.
pub const RELEASE: &str = "rstream-operator";
/// The label selector of the chart's Pods.
pub const SELECTOR: &str = "app.kubernetes.io/instance=rstream-operator";
const CRDS: [&str; 2] = [
    "rstreamconnections.tunnels.rstream.io",
    "rstreamtunnels.tunnels.rstream.io",
];

// The scenarios this chart records, by name (`expected_scenarios` lists them for the run).
pub(crate) const INSTALLED: &str = "chart installed with its CRDs; the manager Ready by its own probe under Pod Security restricted";
pub(crate) const MANAGER_METRICS: &str = "the manager's /metrics through the chart's metrics Service (what the optional ServiceMonitor scrapes) has process_*, the build info, controller-runtime's names and no retired ones";
pub(crate) const HTTP_TUNNEL: &str = "HTTP tunnel (Quick Start): agent Available by its probe, tunnel Ready, a request through the engine reaches the workload Pod via the Service name";
pub(crate) const TCP_TUNNEL: &str =
    "TCP tunnel carries 64 MiB to the workload's echo port and back, intact";
pub(crate) const AGENT_METRICS: &str = "the echo tunnel's agent Pod /metrics has process_*, its build info and the tunnel and stream metrics";
pub(crate) const TOKEN_ROTATED: &str = "token rotated in the Secret, then the old one revoked in the engine: both agents log in again with the new token (the engine's record of each login), a login with the old token is refused, the agent Deployment rolled (config hash), both tunnels carry traffic";
pub(crate) const AGENT_KILLED: &str = "the echo tunnel's agent Pod killed (grace 0) while Ready: a new agent Pod, the tunnel Ready again with a new tunnel id, 1 MiB through it";
pub(crate) const ENGINE_KILLED: &str = "engine process SIGKILLed: web TunnelReady=False and Ready=False while it is down; started again on the same address: the agents open new control connections with the token in force, both tunnels Ready again and carry traffic (recovery time reported)";
pub(crate) const TUNNEL_DELETED: &str =
    "RstreamTunnel deleted: agent Pods, ServiceAccount, Role, RoleBinding and ConfigMap gone";
pub(crate) const CRD_UPGRADE: &str = "helm upgrade to the next chart version, whose RstreamConnection CRD adds an optional spec field: the field is served after the upgrade (pruned before), the existing RstreamConnection survives";
pub(crate) const UNINSTALLED: &str = "helm uninstall with crds.keep (the default): the manager Pod gone; the CRDs and the RstreamConnection stay";

/// The live-stream outage scenario's name (it names [`LIVE_END_LIMIT`]).
pub fn engine_killed_live() -> String {
    format!(
        "engine process SIGKILLed under a live stream through echo: the client sees the stream end (EOF or error) within {LIVE_END_LIMIT:?}; echo Ready=False with a reason while down; engine back: echo Ready, a new stream echoes bytes"
    )
}

/// Every scenario a whole run of this chart records, in order: `cargo xtask e2e` fails a run
/// that misses one or records one not listed here.
pub fn expected_scenarios() -> Vec<String> {
    let mut names: Vec<String> = [
        INSTALLED,
        MANAGER_METRICS,
        HTTP_TUNNEL,
        TCP_TUNNEL,
        AGENT_METRICS,
        TOKEN_ROTATED,
        AGENT_KILLED,
        ENGINE_KILLED,
    ]
    .map(str::to_owned)
    .into();
    names.push(engine_killed_live());
    names.extend(
        [
            TUNNEL_DELETED,
            super::HELM_TEST_SCENARIO,
            CRD_UPGRADE,
            UNINSTALLED,
        ]
        .map(str::to_owned),
    );
    names
}

/// Installs the chart and runs its scenarios.
pub async fn run(env: &Env<'_>) -> ChartReport {
    let mut report = ChartReport::new("rstream-operator");
    // Its restart watch is finished inside the scenarios (the agents' namespace is made there).
    let outcome = scenarios(env, &mut report).await;
    super::finish_chart(report, outcome, None).await
}

async fn scenarios(env: &Env<'_>, report: &mut ChartReport) -> anyhow::Result<()> {
    let ns = env.restricted_namespace("rstream").await?;
    report.namespace = ns.clone();
    // Restart counts across the whole run: the agents are deleted before the end.
    let watch = RestartWatch::start(env.plane, &[&ns]).await?;
    let client = env.plane.client().await?;

    let started = Instant::now();
    let installed = install(env, &ns).await?;
    let pods = check::wait_pods_ready(env.plane, &ns, SELECTOR, 1).await?;
    report.install_to_ready_ms = Some(started.elapsed().as_millis());
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut served = Vec::new();
    for name in CRDS {
        let crd = crds.get(name).await?;
        let established = crd
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        served.push(format!(
            "{name} {}",
            if established {
                "Established"
            } else {
                "not established"
            }
        ));
    }
    report.record(
        INSTALLED,
        served.iter().all(|s| s.ends_with(" Established")),
        started,
        format!(
            "manager {} ({}); {}",
            pods[0].0,
            pods[0].1,
            served.join(", ")
        ),
    );

    let svc: Service = Api::namespaced(client.clone(), &ns)
        .get(&format!("{RELEASE}-metrics"))
        .await?;
    let ip = svc
        .spec
        .and_then(|s| s.cluster_ip)
        .context("no ClusterIP")?;
    let addr: SocketAddr = format!("{ip}:8080").parse()?;
    super::record_metric_names(
        report,
        MANAGER_METRICS,
        &super::Scrape::Open(addr),
        "rstream-operator",
        &["leader_election_master_status"],
    )
    .await;

    if let Err(err) = tunnel_scenarios(env, report, &ns).await {
        report.record(
            "tunnel scenarios",
            false,
            Instant::now(),
            format!("stopped: {err:#}"),
        );
    }

    super::helm_test_scenario(env, report, RELEASE, &ns, &installed, "/readyz").await;

    // A release that adds a CRD field: `helm upgrade` must apply the new schema.
    let started = Instant::now();
    let outcome = crd_upgrade(env, &ns).await;
    report.record(
        CRD_UPGRADE,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );

    report.restarts = watch.finish().await?;
    let started = Instant::now();
    env.helm(&[
        "uninstall",
        RELEASE,
        "-n",
        &ns,
        "--wait",
        "--timeout",
        "90s",
    ])
    .await?;
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let deadline = Instant::now() + Duration::from_secs(90);
    while !pods_api
        .list(&ListParams::default().labels(SELECTOR))
        .await?
        .items
        .is_empty()
    {
        if Instant::now() > deadline {
            bail!("the manager Pod outlived the uninstall by 90 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Helm deletes at once what it deletes: a CRD not kept is gone or terminating by now.
    let mut kept = Vec::new();
    let mut lost = Vec::new();
    for name in CRDS {
        match crds.get_opt(name).await? {
            Some(crd) if crd.metadata.deletion_timestamp.is_none() => kept.push(name),
            Some(_) => lost.push(format!("{name} terminating")),
            None => lost.push(format!("{name} deleted")),
        }
    }
    let conns: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &ApiResource::erase::<RstreamConnection>(&()),
    );
    let survivor = match conns.get_opt(SURVIVOR).await {
        Ok(Some(c)) => format!(
            "RstreamConnection {SURVIVOR} still there ({NEW_FIELD}={})",
            c.data["spec"][NEW_FIELD]
        ),
        Ok(None) => {
            lost.push(format!("RstreamConnection {SURVIVOR} deleted"));
            String::new()
        }
        Err(err) => {
            lost.push(format!("RstreamConnection {SURVIVOR}: {err}"));
            String::new()
        }
    };
    report.record(
        UNINSTALLED,
        lost.is_empty(),
        started,
        if lost.is_empty() {
            format!("no Pod; CRDs kept: {}; {survivor}", kept.join(", "))
        } else {
            format!("lost: {}", lost.join(", "))
        },
    );
    Ok(())
}

/// The RstreamConnection that lives through the CRD upgrade and the uninstall.
const SURVIVOR: &str = "survivor";
/// The optional spec field the next chart version's RstreamConnection CRD adds.
const NEW_FIELD: &str = "e2eUpgradeNote";
/// The name `helm repo add` gives the repository of the next chart version.
const NEXT_REPO: &str = "kube-netkit-next";

/// Installs with the released chart an RstreamConnection, shows the API server prunes
/// [`NEW_FIELD`] from it, upgrades the release to [`next_chart`] from a repository of its own,
/// and shows the CRD now holds the field, the API server keeps it, and the RstreamConnection is
/// the same object (same uid). Ok is the detail; any failed claim is an error naming it.
async fn crd_upgrade(env: &Env<'_>, ns: &str) -> anyhow::Result<String> {
    let client = env.plane.client().await?;
    let conns: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::erase::<RstreamConnection>(&()),
    );
    let created = conns
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": "RstreamConnection",
                "metadata": { "name": SURVIVOR },
                "spec": {
                    "engine": "engine.invalid:443",
                    "tokenSecretRef": { "name": "absent", "key": "token" },
                },
            }))?,
        )
        .await?;
    let uid = created.metadata.uid.clone().context("no uid")?;
    let note = |value: &str| Patch::Merge(json!({ "spec": { NEW_FIELD: value } }));
    let before = conns
        .patch(SURVIVOR, &PatchParams::default(), &note("before"))
        .await?;
    if !before.data["spec"][NEW_FIELD].is_null() {
        bail!("the released CRD already keeps spec.{NEW_FIELD}: the scenario proves nothing");
    }

    let dir = tempfile::tempdir()?;
    let version = next_chart(env, dir.path())?;
    let server = crate::charts::Server::start(&dir.path().join("repo"))?;
    env.repo.add(&env.helm, NEXT_REPO, &server.url())?;
    let upgraded = Instant::now();
    env.helm(&[
        "upgrade",
        RELEASE,
        &format!("{NEXT_REPO}/{RELEASE}"),
        "--version",
        &version,
        "-n",
        ns,
        "--reuse-values",
        "--wait",
        "--timeout",
        "120s",
    ])
    .await?;
    let took = upgraded.elapsed();

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crds.get(CRDS[0]).await?;
    let in_schema = crd.spec.versions.iter().any(|v| {
        v.schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .and_then(|s| s.properties.as_ref())
            .and_then(|p| p.get("spec"))
            .and_then(|s| s.properties.as_ref())
            .is_some_and(|p| p.contains_key(NEW_FIELD))
    });
    let keep = crd
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("helm.sh/resource-policy"))
        .cloned();
    if !in_schema {
        bail!(
            "after helm upgrade to {version} the CRD {} has no spec.{NEW_FIELD}",
            CRDS[0]
        );
    }
    // The API server serves a changed CRD schema a moment after storing it.
    let schema_wait = Instant::now();
    let deadline = schema_wait + Duration::from_secs(60);
    let read_back = loop {
        conns
            .patch(SURVIVOR, &PatchParams::default(), &note("after"))
            .await?;
        let read = conns.get(SURVIVOR).await?;
        if read.data["spec"][NEW_FIELD] == "after" || Instant::now() > deadline {
            break read;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    if read_back.data["spec"][NEW_FIELD] != "after" {
        bail!("the CRD lists spec.{NEW_FIELD}, but the API server still prunes it");
    }
    if read_back.metadata.uid.as_deref() != Some(uid.as_str()) {
        bail!(
            "RstreamConnection {SURVIVOR} was replaced (uid {uid} -> {:?})",
            read_back.metadata.uid
        );
    }
    Ok(format!(
        "before: spec.{NEW_FIELD} pruned; helm upgrade to chart {version} from {NEXT_REPO} in {took:.1?}; \
         after: the CRD's schema lists it, a patch with it reads back {NEW_FIELD}={} (served {:.1?} after the upgrade), \
         RstreamConnection {SURVIVOR} keeps uid {uid}; CRD helm.sh/resource-policy={keep:?}",
        read_back.data["spec"][NEW_FIELD],
        schema_wait.elapsed()
    ))
}

/// The next release of the chart, made from the packaged one: its version one patch on, its
/// RstreamConnection CRD with one more optional spec field, [`NEW_FIELD`] (written by the same
/// codegen as the chart's own templates), packaged and indexed in `<out>/repo`. Returns the
/// version.
fn next_chart(env: &Env<'_>, out: &std::path::Path) -> anyhow::Result<String> {
    let packaged = env
        .repo
        .charts
        .iter()
        .find(|c| c.name == RELEASE)
        .context("rstream-operator is not in the repository")?;
    let src = out.join("src");
    std::fs::create_dir_all(&src)?;
    let status = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(&packaged.archive)
        .arg("-C")
        .arg(&src)
        .status()?;
    if !status.success() {
        bail!("tar -xzf {} failed", packaged.archive.display());
    }
    let chart = src.join(RELEASE);
    let (major_minor, patch) = packaged
        .version
        .rsplit_once('.')
        .context("chart version is not x.y.z")?;
    let version = format!("{major_minor}.{}", patch.parse::<u64>()? + 1);
    let chart_yaml = std::fs::read_to_string(chart.join("Chart.yaml"))?;
    let current = format!("version: {}\n", packaged.version);
    if !chart_yaml.contains(&current) {
        bail!("Chart.yaml has no line {current:?}");
    }
    std::fs::write(
        chart.join("Chart.yaml"),
        chart_yaml.replace(&current, &format!("version: {version}\n")),
    )?;

    let mut crd = <RstreamConnection as kube::CustomResourceExt>::crd();
    let spec = crd
        .spec
        .versions
        .iter_mut()
        .filter_map(|v| v.schema.as_mut()?.open_api_v3_schema.as_mut())
        .filter_map(|s| s.properties.as_mut()?.get_mut("spec"))
        .next()
        .context("the RstreamConnection CRD has no spec schema")?;
    spec.properties.get_or_insert_with(Default::default).insert(
        NEW_FIELD.to_owned(),
        JSONSchemaProps {
            type_: Some("string".to_owned()),
            description: Some("Added by the next chart version (e2e CRD upgrade).".to_owned()),
            ..JSONSchemaProps::default()
        },
    );
    let file = format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural);
    let template = chart.join("templates/crds").join(&file);
    if !template.is_file() {
        bail!("the packaged chart has no template {}", template.display());
    }
    std::fs::write(
        template,
        crate::charts::chart_template(&serde_yaml_ng::to_string(&crd)?, "rstream-operator.labels")?,
    )?;
    let repo = out.join("repo");
    std::fs::create_dir_all(&repo)?;
    crate::charts::package_dir(&env.helm, &chart, &repo)?;
    crate::charts::index(&env.helm, &repo)?;
    Ok(version)
}

const TOKEN: &str = "e2e-token-1";
/// The token the rotation scenario moves the agents to.
const TOKEN_2: &str = "e2e-token-2";

/// What the scenarios need of an engine: its address, its CA and a tunnel's ingress.
pub trait EngineView {
    /// The engine address agents dial.
    fn engine_address(&self) -> String;
    /// The CA certificate (PEM) agents trust.
    fn ca_pem(&self) -> String;
    /// The published TCP ingress of a tunnel.
    fn ingress_addr(&self, tunnel_id: &str) -> Option<SocketAddr>;
}

impl EngineView for LocalEngine {
    fn engine_address(&self) -> String {
        LocalEngine::engine_address(self)
    }
    fn ca_pem(&self) -> String {
        LocalEngine::ca_pem(self).to_owned()
    }
    fn ingress_addr(&self, tunnel_id: &str) -> Option<SocketAddr> {
        LocalEngine::ingress_addr(self, tunnel_id)
    }
}

/// A control-channel login the engine process reported.
#[derive(Clone, Debug)]
pub struct Login {
    /// The client id it logged in with.
    pub client_id: String,
    /// The token it presented.
    pub token: String,
    /// Whether the engine accepted it.
    pub accepted: bool,
    /// Whether the channel is still open.
    pub open: bool,
}

impl std::fmt::Display for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let outcome = if !self.accepted {
            "refused"
        } else if self.open {
            "open"
        } else {
            "closed"
        };
        write!(f, "{} {} ({outcome})", self.client_id, self.token)
    }
}

fn logins_text(logins: &[Login]) -> String {
    if logins.is_empty() {
        return "none".to_owned();
    }
    logins
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

#[derive(Default)]
struct EngineEvents {
    logins: Vec<Login>,
    tunnels: std::collections::HashMap<String, SocketAddr>,
    auth_acks: u64,
}

/// LocalEngine as a process of its own (the `local_engine` example), so a scenario can SIGKILL
/// it: its events (logins with their token, tunnels with their ingress) read from its stdout,
/// its accepted tokens changed through its stdin.
pub struct EngineProcess {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    addr: SocketAddr,
    ca_pem: String,
    events: std::sync::Arc<std::sync::Mutex<EngineEvents>>,
}

/// How long the engine process may take to listen, or to acknowledge a command.
const ENGINE_PROCESS_LIMIT: Duration = Duration::from_secs(30);

impl EngineProcess {
    /// Starts `bin` listening on `listen` with the identity in `identity` (JSON), accepting
    /// exactly `tokens`.
    pub async fn start(
        bin: &std::path::Path,
        listen: SocketAddr,
        identity: &std::path::Path,
        ca_pem: &str,
        tokens: &[&str],
    ) -> anyhow::Result<Self> {
        use tokio::io::AsyncBufReadExt as _;
        let mut cmd = tokio::process::Command::new(bin);
        cmd.arg("--listen")
            .arg(listen.to_string())
            .arg("--identity")
            .arg(identity)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        for token in tokens {
            cmd.args(["--token", token]);
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdin = child.stdin.take().context("no stdin")?;
        let mut lines =
            tokio::io::BufReader::new(child.stdout.take().context("no stdout")?).lines();
        let first = tokio::time::timeout(ENGINE_PROCESS_LIMIT, lines.next_line())
            .await
            .with_context(|| {
                format!("the engine process did not listen within {ENGINE_PROCESS_LIMIT:?}")
            })??
            .context("the engine process ended before listening")?;
        let addr: SocketAddr = first
            .strip_prefix("listening ")
            .with_context(|| format!("the engine process said {first:?}, not listening"))?
            .parse()?;
        let events = std::sync::Arc::new(std::sync::Mutex::new(EngineEvents::default()));
        let sink = events.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let words: Vec<&str> = line.split(' ').collect();
                let mut ev = sink.lock().unwrap_or_else(|p| p.into_inner());
                match words.as_slice() {
                    ["login", id, outcome, token] => ev.logins.push(Login {
                        client_id: (*id).to_owned(),
                        token: (*token).to_owned(),
                        accepted: *outcome == "accepted",
                        open: *outcome == "accepted",
                    }),
                    ["closed", id] => {
                        for l in ev.logins.iter_mut().filter(|l| l.client_id == *id) {
                            l.open = false;
                        }
                    }
                    ["tunnel", id, ingress] => {
                        if let Ok(ingress) = ingress.parse() {
                            ev.tunnels.insert((*id).to_owned(), ingress);
                        }
                    }
                    ["tunnel-closed", id] => {
                        ev.tunnels.remove(*id);
                    }
                    ["auth", ..] => ev.auth_acks += 1,
                    _ => {}
                }
            }
        });
        Ok(Self {
            child,
            stdin,
            addr,
            ca_pem: ca_pem.to_owned(),
            events,
        })
    }

    fn events(&self) -> std::sync::MutexGuard<'_, EngineEvents> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every login so far, in order.
    pub fn logins(&self) -> Vec<Login> {
        self.events().logins.clone()
    }

    /// Accept exactly `tokens` from now on; the engine closes the channels of any other token.
    /// Returns once the engine acknowledged it.
    pub async fn set_tokens(&mut self, tokens: &[&str]) -> anyhow::Result<()> {
        use tokio::io::AsyncWriteExt as _;
        let acks = self.events().auth_acks;
        self.stdin
            .write_all(format!("tokens {}\n", tokens.join(" ")).as_bytes())
            .await?;
        self.stdin.flush().await?;
        let started = Instant::now();
        while self.events().auth_acks == acks {
            if started.elapsed() > ENGINE_PROCESS_LIMIT {
                bail!(
                    "the engine process did not acknowledge tokens {tokens:?} within {ENGINE_PROCESS_LIMIT:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// SIGKILL: the process ends at once, every connection with it.
    pub async fn kill(mut self) -> anyhow::Result<()> {
        self.child.start_kill()?;
        self.child.wait().await?;
        Ok(())
    }

    /// Ends the process (`quit`, then SIGKILL after 10 s).
    pub async fn shutdown(mut self) {
        use tokio::io::AsyncWriteExt as _;
        let _ = self.stdin.write_all(b"quit\n").await;
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.start_kill();
            let _ = self.child.wait().await;
        }
    }
}

impl EngineView for EngineProcess {
    fn engine_address(&self) -> String {
        self.addr.to_string()
    }
    fn ca_pem(&self) -> String {
        self.ca_pem.clone()
    }
    fn ingress_addr(&self, tunnel_id: &str) -> Option<SocketAddr> {
        self.events().tunnels.get(tunnel_id).copied()
    }
}

/// The ingress of `tunnel_id`, waiting up to 30 s for the engine to report it (a separate
/// engine process reports a new tunnel a moment after the agent sees it open).
async fn wait_ingress(engine: &(impl EngineView + ?Sized), tunnel_id: &str) -> Option<SocketAddr> {
    let started = Instant::now();
    loop {
        if let Some(addr) = engine.ingress_addr(tunnel_id) {
            return Some(addr);
        }
        if started.elapsed() > Duration::from_secs(30) {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Builds the `local_engine` example (a no-op when it is up to date); returns its path.
async fn build_engine_process() -> anyhow::Result<std::path::PathBuf> {
    let root = crate::workspace::root();
    let mut cmd =
        std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    cmd.current_dir(&root).args([
        "build",
        "--quiet",
        "-p",
        "examples",
        "--example",
        "local_engine",
    ]);
    crate::workspace::without_run_env(&mut cmd);
    let status = tokio::task::spawn_blocking(move || cmd.status())
        .await?
        .context("running cargo build -p examples --example local_engine")?;
    if !status.success() {
        bail!("building the local_engine example failed ({status})");
    }
    Ok(crate::workspace::target_dir(&root).join("debug/examples/local_engine"))
}

/// A tunnel's condition `(status, reason, message)`.
fn condition(t: &RstreamTunnel, type_: &str) -> Option<(String, String, String)> {
    t.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Waits until `name`'s condition `type_` has `status`; returns the tunnel, or the last status.
pub async fn wait_condition(
    tunnels: &Api<RstreamTunnel>,
    name: &str,
    type_: &str,
    status: &str,
    limit: Duration,
) -> anyhow::Result<RstreamTunnel> {
    let started = Instant::now();
    loop {
        let t = tunnels.get(name).await?;
        if condition(&t, type_).is_some_and(|(s, _, _)| s == status) {
            return Ok(t);
        }
        if started.elapsed() > limit {
            bail!(
                "{name}: {type_} not {status} within {limit:?}; conditions: {:?}",
                t.status.and_then(|s| s.conditions).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The IP of a running agent Pod of tunnel `tunnel`.
async fn agent_pod_ip(
    client: &kube::Client,
    ns: &str,
    tunnel: &str,
) -> anyhow::Result<std::net::IpAddr> {
    let (deployment, pods) = agent_pods(client, ns, tunnel).await?;
    pods.into_iter()
        .filter_map(|p| p.status?.pod_ip)
        .find_map(|ip| ip.parse().ok())
        .with_context(|| format!("no agent Pod of {deployment} has an IP"))
}

/// The agent Deployment of tunnel `tunnel` (from its status) and the Pods its selector matches.
async fn agent_pods(
    client: &kube::Client,
    ns: &str,
    tunnel: &str,
) -> anyhow::Result<(String, Vec<Pod>)> {
    let status = Api::<RstreamTunnel>::namespaced(client.clone(), ns)
        .get(tunnel)
        .await?
        .status
        .context("the tunnel has no status")?;
    let deployment = status
        .agent_deployment
        .context("no agent Deployment in the status")?;
    let labels = Api::<Deployment>::namespaced(client.clone(), ns)
        .get(&deployment)
        .await?
        .spec
        .selector
        .match_labels
        .context("the agent Deployment has no selector")?;
    let selector: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&selector.join(",")))
        .await?;
    Ok((deployment, pods.items))
}

/// Waits until the Deployment `name` is `Available`; false if it is not within `limit`.
async fn wait_available(
    deployments: &Api<Deployment>,
    name: &str,
    limit: Duration,
) -> anyhow::Result<bool> {
    let started = Instant::now();
    loop {
        let available = deployments
            .get(name)
            .await?
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| {
                c.type_.as_deref() == Some("Available") && c.status.as_deref() == Some("True")
            });
        if available || started.elapsed() > limit {
            return Ok(available);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The engine Pods reach: LocalEngine on the host's end of the node link, its certificate naming
/// that address, as a self-hosted engine with a private CA.
pub async fn start_engine(identity: Option<EngineIdentity>) -> anyhow::Result<LocalEngine> {
    let identity = match identity {
        Some(identity) => identity,
        None => EngineIdentity::generate_for(&[&node::HOST_IP.to_string()])?,
    };
    Ok(LocalEngine::builder()
        .bind(SocketAddr::new(node::HOST_IP.into(), 0))
        .identity(identity)
        .start()
        .await?)
}

/// The seed's Quick Start on the node: a workload behind a Service, an RstreamConnection with
/// the engine's CA by Secret reference, an HTTP and a TCP tunnel; then rotation, an engine
/// outage and deletion. The engine is a process of its own (SIGKILLed in the outage) accepting
/// only the Secret's token.
async fn tunnel_scenarios(env: &Env<'_>, report: &mut ChartReport, ns: &str) -> anyhow::Result<()> {
    let client = env.plane.client().await?;
    let started = Instant::now();
    let bin = build_engine_process().await?;
    let dir = tempfile::tempdir()?;
    let identity_file = dir.path().join("engine-identity.json");
    let identity = EngineIdentity::generate_for(&[&node::HOST_IP.to_string()])?;
    std::fs::write(&identity_file, identity.to_json())?;
    let mut engine = EngineProcess::start(
        &bin,
        SocketAddr::new(node::HOST_IP.into(), 0),
        &identity_file,
        identity.ca_pem(),
        &[TOKEN],
    )
    .await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let tunnels: Api<RstreamTunnel> = Api::namespaced(client.clone(), ns);
    quick_start(
        &client,
        ns,
        &engine,
        &[("web", http_tunnel_spec()), ("echo", tcp_tunnel_spec())],
    )
    .await?;

    // 1. The agent Deployment becomes Available by its own probe; the tunnel is Ready; a request
    //    to the engine's ingress reaches the workload Pod through the Service's DNS name.
    let outcome = match http_tunnel(env, &engine, ns, "web").await {
        Ok(web) => (web.passed(), web.describe()),
        Err(err) => (false, format!("{err:#}")),
    };
    report.record(HTTP_TUNNEL, outcome.0, started, outcome.1);

    // 2. 64 MiB through a TCP tunnel, intact.
    let started = Instant::now();
    let outcome =
        match wait_condition(&tunnels, "echo", "Ready", "True", Duration::from_secs(90)).await {
            Ok(t) => {
                let tunnel_id = t.status.and_then(|s| s.tunnel_id).unwrap_or_default();
                match wait_ingress(&engine, &tunnel_id).await {
                    Some(ingress) => echo_bulk(ingress, 64 << 20).await,
                    None => Err(anyhow::anyhow!("the engine has no ingress for {tunnel_id}")),
                }
            }
            Err(err) => Err(err),
        };
    report.record(
        TCP_TUNNEL,
        outcome.is_ok(),
        started,
        match outcome {
            Ok(took) => format!(
                "64 MiB each way in {took:.2?} ({:.0} MiB/s)",
                64.0 / took.as_secs_f64()
            ),
            Err(err) => format!("{err:#}"),
        },
    );

    // The echo tunnel's agent counted what it carried, under the names its README lists.
    match agent_pod_ip(&client, ns, "echo").await {
        Ok(ip) => {
            let port = u16::try_from(rstream_operator::manager::children::HEALTH_PORT)?;
            let addr = SocketAddr::new(ip, port);
            super::record_metric_names(
                report,
                AGENT_METRICS,
                &super::Scrape::Open(addr),
                "rstream-agent",
                &[
                    "rstream_agent_tunnel_online",
                    "rstream_agent_streams",
                    "rstream_agent_stream_bytes",
                ],
            )
            .await;
        }
        Err(err) => report.record(AGENT_METRICS, false, Instant::now(), format!("{err:#}")),
    }

    // 3. Token rotation: the engine accepts both tokens, the Secret changes, the agents roll
    //    (config hash) and log in with the new token; then the engine revokes the old one (any
    //    channel still on it is closed, a login with it refused) and both tunnels carry traffic.
    let started = Instant::now();
    let outcome = match rotate_token(&tunnels, &deployments, &secrets, &mut engine).await {
        Ok((rotated, revoked_at)) => match traffic(&tunnels, &engine).await {
            Ok(sent) => after_revocation(&engine, revoked_at)
                .map(|logins| format!("{rotated}; then {sent}; {logins}")),
            Err(err) => Err(err.context(format!(
                "{rotated}; logins since the revocation: {}",
                logins_text(&engine.logins()[revoked_at..])
            ))),
        },
        Err(err) => Err(err),
    };
    report.record(
        TOKEN_ROTATED,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );

    // 4. The echo tunnel's agent Pod killed: its replacement brings the tunnel back.
    let started = Instant::now();
    let outcome = kill_agent(&client, ns, &tunnels, &engine, "echo").await;
    report.record(
        AGENT_KILLED,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );

    // 5. The engine process SIGKILLed under a live stream through echo: the stream ends at the
    //    client; echo Ready=False with a reason, web TunnelReady=False and Ready=False while it is
    //    down; started again on the same address with the same certificate: the agents log in
    //    again (new control connections, the token in force), both tunnels Ready, traffic flows,
    //    a new stream through echo echoes bytes.
    let started = Instant::now();
    let live = open_stream(&tunnels, &engine, "echo", LIVE_BYTES).await;
    let addr = engine.addr();
    let (live_end, _keep_write) = match live {
        Ok(stream) => {
            let (read, write) = stream.into_split();
            (Ok(tokio::spawn(stream_end(read))), Some(write))
        }
        Err(err) => (Err(err), None),
    };
    let killed = Instant::now();
    engine.kill().await?;
    let ended = match live_end {
        Ok(task) => match tokio::time::timeout(LIVE_END_LIMIT, task).await {
            Ok(Ok((at, how))) => Ok((at - killed, how)),
            Ok(Err(err)) => Err(anyhow::anyhow!("the stream reader: {err}")),
            Err(_) => Err(anyhow::anyhow!(
                "the stream through echo was still open {LIVE_END_LIMIT:?} after the engine was killed"
            )),
        },
        Err(err) => Err(err.context("opening the live stream through echo")),
    };
    let echo_down = wait_condition(&tunnels, "echo", "Ready", "False", OUTAGE_LIMIT)
        .await
        .map(|t| (killed.elapsed(), t));
    let web_down = wait_condition(&tunnels, "web", "TunnelReady", "False", OUTAGE_LIMIT)
        .await
        .map(|t| (killed.elapsed(), t));
    let web_unready = web_down
        .as_ref()
        .ok()
        .and_then(|(_, t)| condition(t, "Ready"));
    engine =
        EngineProcess::start(&bin, addr, &identity_file, identity.ca_pem(), &[TOKEN_2]).await?;
    let restarted = Instant::now();
    let relogin = wait_logins(&engine, TOKEN_2, 2, OUTAGE_LIMIT).await;
    let back = wait_condition(&tunnels, "web", "Ready", "True", OUTAGE_LIMIT)
        .await
        .map(|_| restarted.elapsed());
    let echo_back = wait_condition(&tunnels, "echo", "Ready", "True", OUTAGE_LIMIT)
        .await
        .map(|_| restarted.elapsed());
    let sent = match (&back, &echo_back) {
        (Ok(_), Ok(_)) => traffic(&tunnels, &engine)
            .await
            .map(|sent| (restarted.elapsed(), sent)),
        _ => Err(anyhow::anyhow!("not tried: the tunnels are not Ready")),
    };
    let web_was_down = web_unready.as_ref().is_some_and(|(s, _, _)| s == "False");
    report.record(
        ENGINE_KILLED,
        web_down.is_ok() && web_was_down && relogin.is_ok() && back.is_ok() && sent.is_ok(),
        started,
        format!(
            "while down: {}; after the restart: {}; {}; {}",
            match &web_down {
                Ok((at, t)) => format!(
                    "TunnelReady {:?}, Ready {:?} (seen {at:.1?} after the kill)",
                    condition(t, "TunnelReady"),
                    condition(t, "Ready")
                ),
                Err(e) => format!("{e:#}"),
            },
            match &relogin {
                Ok((at, logins)) =>
                    format!("the agents logged in again {at:.1?} after it: {logins}"),
                Err(e) => format!("{e:#}"),
            },
            match &back {
                Ok(at) => format!("web Ready {at:.1?} after the restart"),
                Err(e) => format!("{e:#}"),
            },
            match &sent {
                Ok((at, sent)) => format!("{sent} (done {at:.1?} after the restart)"),
                Err(e) => format!("{e:#}"),
            },
        ),
    );
    let fresh = match &echo_back {
        Ok(_) => echo_through(&tunnels, &engine, "echo", LIVE_BYTES)
            .await
            .map(|(took, tries)| (restarted.elapsed(), took, tries)),
        Err(_) => Err(anyhow::anyhow!("not tried: echo is not Ready")),
    };
    // Not-Ready with a reason: the condition names why.
    let echo_reason = echo_down
        .as_ref()
        .ok()
        .and_then(|(_, t)| condition(t, "Ready"));
    let reasoned = echo_reason.as_ref().is_some_and(|(_, r, _)| !r.is_empty());
    report.record(
        &engine_killed_live(),
        ended.is_ok() && reasoned && echo_back.is_ok() && fresh.is_ok(),
        started,
        format!(
            "live stream: {}; echo while down: {}; engine back: {}; new stream: {}",
            match &ended {
                Ok((at, how)) => format!(
                    "{LIVE_BYTES} bytes echoed, then {how} {at:.2?} after the SIGKILL"
                ),
                Err(e) => format!("{e:#}"),
            },
            match &echo_down {
                Ok((at, t)) => format!(
                    "Ready {:?}, TunnelReady {:?} (seen {at:.1?} after the kill)",
                    condition(t, "Ready"),
                    condition(t, "TunnelReady")
                ),
                Err(e) => format!("{e:#}"),
            },
            match &echo_back {
                Ok(at) => format!("echo Ready {at:.1?} after the engine restarted"),
                Err(e) => format!("{e:#}"),
            },
            match &fresh {
                Ok((at, took, tries)) => format!(
                    "{LIVE_BYTES} bytes intact in {took:.2?} (try {tries}), {at:.1?} after the engine restarted"
                ),
                Err(e) => format!("{e:#}"),
            },
        ),
    );

    // 6. Deleting the tunnel removes its agent and every child (finalizer and garbage collector).
    let started = Instant::now();
    let outcome = delete_tunnel(env, &tunnels, ns, "web").await;
    report.record(
        TUNNEL_DELETED,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );
    tunnels.delete("echo", &DeleteParams::default()).await?;
    engine.shutdown().await;
    Ok(())
}

/// `helm install` of the chart with the release image (its CRDs included); returns helm's
/// output.
pub async fn install(env: &Env<'_>, ns: &str) -> anyhow::Result<String> {
    let (repository, tag) = env.image("rstream-operator")?;
    // The scenarios scrape /metrics as plain HTTP: they are not about who may scrape (the
    // secure default is covered by k8s-reconcile's tests/secure_metrics.rs).
    let values = [format!(
        "image.repository={repository},image.tag={tag},metrics.secure=false"
    )];
    env.install_chart(RELEASE, ns, &values).await
}

/// The Quick Start's HTTP tunnel: port `http` of Service `web`, published.
pub fn http_tunnel_spec() -> serde_json::Value {
    json!({ "target": { "service": { "name": "web", "port": "http" } },
            "publish": true, "protocol": "http", "http": { "version": "http/1.1" } })
}

/// A TCP tunnel to the workload's echo port, published.
pub fn tcp_tunnel_spec() -> serde_json::Value {
    json!({ "target": { "service": { "name": "web", "port": "tcp-echo" } },
            "publish": true, "protocol": "tcp" })
}

/// The seed's Quick Start in `ns`: the testbox workload `web` behind Service `web` (`http` and
/// `tcp-echo`), Secret `rstream-credentials` with the token and `engine`'s CA, RstreamConnection
/// `default` pointing at `engine` with the CA by Secret reference, and one RstreamTunnel per
/// `(name, spec)`.
pub async fn quick_start(
    client: &kube::Client,
    ns: &str,
    engine: &(impl EngineView + ?Sized),
    tunnel_specs: &[(&str, serde_json::Value)],
) -> anyhow::Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(check::testbox_deployment("web", 1))?,
        )
        .await?;
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "web" },
                "spec": { "selector": { "app": "web" }, "ports": [
                    { "name": "http", "port": 80, "targetPort": 8080 },
                    { "name": "tcp-echo", "port": 9000, "targetPort": 9000 },
                ]},
            }))?,
        )
        .await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "rstream-credentials" },
                "stringData": { "token": TOKEN, "ca.crt": engine.ca_pem() },
            }))?,
        )
        .await?;
    let connections: Api<RstreamConnection> = Api::namespaced(client.clone(), ns);
    connections
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": "RstreamConnection",
                "metadata": { "name": "default" },
                "spec": {
                    "engine": engine.engine_address(),
                    "tokenSecretRef": { "name": "rstream-credentials", "key": "token" },
                    "caSecretRef": { "name": "rstream-credentials", "key": "ca.crt" },
                },
            }))?,
        )
        .await?;
    let tunnels: Api<RstreamTunnel> = Api::namespaced(client.clone(), ns);
    for (name, spec) in tunnel_specs {
        tunnels
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": "RstreamTunnel",
                    "metadata": { "name": name }, "spec": spec,
                }))?,
            )
            .await?;
    }
    Ok(())
}

/// What the HTTP tunnel of the Quick Start showed.
pub struct HttpTunnel {
    /// The agent Deployment's name.
    pub agent_deployment: String,
    /// Whether that Deployment was Available.
    pub agent_available: bool,
    /// The tunnel id in the status.
    pub tunnel_id: String,
    /// The forwarding address in the status.
    pub forwarding_address: String,
    /// The ingress the request went to, if the engine has one for the tunnel.
    pub ingress: Option<SocketAddr>,
    /// How many requests it took to get an answer.
    pub attempts: u32,
    /// The body of the last answer through the engine, or why there was none.
    pub answer: Result<String, String>,
}

impl HttpTunnel {
    /// The agent is Available and the workload Pod answered through the engine.
    pub fn passed(&self) -> bool {
        self.agent_available && self.reached_pod()
    }

    /// The testbox names its Pod in its answer.
    pub fn reached_pod(&self) -> bool {
        self.answer
            .as_ref()
            .is_ok_and(|a| a.contains("\"pod\":\"web-"))
    }

    /// One line for the report.
    pub fn describe(&self) -> String {
        format!(
            "agent Deployment {} Available={}; forwarding address {}; GET / through the engine (attempt {}): {}",
            self.agent_deployment,
            self.agent_available,
            self.forwarding_address,
            self.attempts,
            match &self.answer {
                Ok(a) => a.lines().last().unwrap_or_default().to_owned(),
                Err(e) => e.clone(),
            }
        )
    }
}

/// Waits for HTTP tunnel `name` to be Ready and its agent Deployment Available by its probe, then
/// GETs `/` through the engine's ingress until the workload Pod answers (within
/// [`TRAFFIC_LIMIT`]).
pub async fn http_tunnel(
    env: &Env<'_>,
    engine: &(impl EngineView + ?Sized),
    ns: &str,
    name: &str,
) -> anyhow::Result<HttpTunnel> {
    let client = env.plane.client().await?;
    let tunnels: Api<RstreamTunnel> = Api::namespaced(client.clone(), ns);
    let deployments: Api<Deployment> = Api::namespaced(client, ns);
    let tunnel = wait_condition(&tunnels, name, "Ready", "True", Duration::from_secs(120)).await?;
    let status = tunnel.status.unwrap_or_default();
    let agent = status.agent_deployment.unwrap_or_default();
    // The agent reports Ready itself; the Deployment controller sets Available after the
    // kubelet's probe and the ReplicaSet's count have caught up, a moment later.
    let available = wait_available(&deployments, &agent, Duration::from_secs(60)).await?;
    let tunnel_id = status.tunnel_id.unwrap_or_default();
    // The tunnel can be Ready before the workload is: its Pod must be Ready and its endpoint
    // routed by kube-proxy before the agent's dial to the Service lands.
    check::wait_pods_ready(env.plane, ns, "app=web", 1).await?;
    let ingress = wait_ingress(engine, &tunnel_id).await;
    let mut outcome = HttpTunnel {
        agent_deployment: agent,
        agent_available: available,
        tunnel_id,
        forwarding_address: status.forwarding_address.unwrap_or_default(),
        ingress,
        attempts: 0,
        answer: Err("not tried".to_owned()),
    };
    let asked = Instant::now();
    loop {
        outcome.attempts += 1;
        outcome.answer = match ingress {
            Some(ingress) => check::http_get(ingress, "/").await,
            None => Err(format!(
                "the engine has no ingress for {}",
                outcome.tunnel_id
            )),
        };
        if outcome.reached_pod() || asked.elapsed() > TRAFFIC_LIMIT {
            return Ok(outcome);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Writes `len` pseudo-random bytes through `addr` (an echo behind a tunnel) while reading them
/// back; fails unless every byte returns in order.
async fn echo_bulk(addr: SocketAddr, len: usize) -> anyhow::Result<Duration> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let data: Vec<u8> = (0..len as u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let started = Instant::now();
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut read, mut write) = stream.into_split();
    let sent = data.clone();
    let writer = tokio::spawn(async move {
        write.write_all(&sent).await?;
        write.shutdown().await?;
        anyhow::Ok(())
    });
    let mut back = Vec::with_capacity(len);
    tokio::time::timeout(Duration::from_secs(120), read.read_to_end(&mut back))
        .await
        .context("echo did not finish within 120 s")??;
    writer.await??;
    if back.len() != len {
        bail!("{} of {len} bytes came back", back.len());
    }
    if let Some(at) = back.iter().zip(&data).position(|(a, b)| a != b) {
        bail!("byte {at} differs");
    }
    Ok(started.elapsed())
}

/// How long traffic may take to flow again after a step (the agent reconnecting, kube-proxy).
const TRAFFIC_LIMIT: Duration = Duration::from_secs(60);

/// Bytes through both tunnels of [`tunnel_scenarios`] after a step: `GET /` through `web` until
/// the workload Pod answers, then 1 MiB through `echo` and back intact, each within
/// [`TRAFFIC_LIMIT`]; the ingress is looked up from the tunnel's status each try (an engine
/// restart makes new tunnels).
async fn traffic(
    tunnels: &Api<RstreamTunnel>,
    engine: &(impl EngineView + ?Sized),
) -> anyhow::Result<String> {
    let started = Instant::now();
    let ingress = |t: RstreamTunnel| {
        let id = t.status.and_then(|s| s.tunnel_id).unwrap_or_default();
        engine
            .ingress_addr(&id)
            .ok_or_else(|| format!("the engine has no ingress for tunnel {id:?}"))
    };
    let mut tries = 0u32;
    let answer = loop {
        tries += 1;
        let last = match ingress(tunnels.get("web").await?) {
            Ok(addr) => match check::http_get(addr, "/").await {
                Ok(body) if body.contains("\"pod\":\"web-") => {
                    break body.lines().last().unwrap_or_default().to_owned();
                }
                Ok(body) => format!(
                    "an answer without the workload Pod: {}",
                    body.chars().take(200).collect::<String>()
                ),
                Err(e) => e,
            },
            Err(e) => e,
        };
        if started.elapsed() > TRAFFIC_LIMIT {
            bail!(
                "no answer from the workload through tunnel web within {TRAFFIC_LIMIT:?} ({tries} tries): {last}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let http_after = started.elapsed();
    let (echoed, echo_tries) = echo_through(tunnels, engine, "echo", 1 << 20).await?;
    Ok(format!(
        "GET / through web answered by the workload after {http_after:.1?} (try {tries}: {answer}); 1 MiB through echo intact in {echoed:.2?} (try {echo_tries})"
    ))
}

/// `len` bytes through TCP tunnel `name` (its ingress looked up from its status each try) and
/// back intact, on a new connection, within [`TRAFFIC_LIMIT`]; returns the echo's time and the
/// tries it took.
async fn echo_through(
    tunnels: &Api<RstreamTunnel>,
    engine: &(impl EngineView + ?Sized),
    name: &str,
    len: usize,
) -> anyhow::Result<(Duration, u32)> {
    let started = Instant::now();
    let mut tries = 0u32;
    loop {
        tries += 1;
        let id = (tunnels.get(name).await?.status)
            .and_then(|s| s.tunnel_id)
            .unwrap_or_default();
        let last = match engine.ingress_addr(&id) {
            Some(addr) => match echo_bulk(addr, len).await {
                Ok(took) => return Ok((took, tries)),
                Err(e) => format!("{e:#}"),
            },
            None => format!("the engine has no ingress for tunnel {id:?}"),
        };
        if started.elapsed() > TRAFFIC_LIMIT {
            bail!(
                "{len} bytes did not come back through tunnel {name} within {TRAFFIC_LIMIT:?} ({tries} tries): {last}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How long a killed agent's replacement may take to bring its tunnel back.
const AGENT_REPLACED_LIMIT: Duration = Duration::from_secs(90);

/// Kills tunnel `name`'s agent Pod (grace 0) while the tunnel is Ready; the Deployment's
/// replacement must bring it back: a new agent Pod (another uid) Ready with no container
/// restarted, the tunnel Ready with a new tunnel id (the one the new agent opened), then 1 MiB
/// through it on a new connection. Ok is the detail.
async fn kill_agent(
    client: &kube::Client,
    ns: &str,
    tunnels: &Api<RstreamTunnel>,
    engine: &(impl EngineView + ?Sized),
    name: &str,
) -> anyhow::Result<String> {
    let before = wait_condition(tunnels, name, "Ready", "True", Duration::from_secs(60)).await?;
    let old_id = (before.status.and_then(|s| s.tunnel_id)).context("no tunnel id in the status")?;
    let (deployment, pods) = agent_pods(client, ns, name).await?;
    let [victim] = pods.as_slice() else {
        bail!(
            "{} agent Pods of {deployment} before the kill, want 1",
            pods.len()
        );
    };
    let victim_name = victim.metadata.name.clone().unwrap_or_default();
    let victim_uid = victim.metadata.uid.clone().unwrap_or_default();
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let killed = Instant::now();
    pods_api
        .delete(&victim_name, &DeleteParams::default().grace_period(0))
        .await?;
    // The tunnel's Ready as sampled meanwhile (the first not-True one, when seen).
    let mut not_ready: Option<(String, Duration)> = None;
    let (replacement, new_id) = loop {
        let t = tunnels.get(name).await?;
        let ready = condition(&t, "Ready");
        if let Some((status, reason, _)) = &ready
            && status != "True"
            && not_ready.is_none()
        {
            not_ready = Some((format!("{status} ({reason})"), killed.elapsed()));
        }
        let id = t.status.and_then(|s| s.tunnel_id).unwrap_or_default();
        let (_, pods) = agent_pods(client, ns, name).await?;
        let new = pods
            .into_iter()
            .find(|p| p.metadata.uid.as_deref() != Some(victim_uid.as_str()) && check::is_ready(p));
        if let Some(new) = new
            && ready.as_ref().is_some_and(|(s, _, _)| s == "True")
            && id != old_id
        {
            break (new, id);
        }
        if killed.elapsed() > AGENT_REPLACED_LIMIT {
            bail!(
                "within {AGENT_REPLACED_LIMIT:?} of killing {victim_name}: Ready {ready:?}, tunnel id {id:?} (was {old_id:?}), agent Pods {:?}",
                agent_pods(client, ns, name)
                    .await?
                    .1
                    .iter()
                    .map(|p| p.metadata.name.clone().unwrap_or_default())
                    .collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let ready_after = killed.elapsed();
    let replacement_name = replacement.metadata.name.clone().unwrap_or_default();
    let restarts: Vec<(String, i32)> = (replacement.status.and_then(|s| s.container_statuses))
        .unwrap_or_default()
        .into_iter()
        .map(|c| (c.name, c.restart_count))
        .collect();
    if restarts.iter().any(|(_, r)| *r != 0) {
        bail!("the replacement agent {replacement_name} restarted: {restarts:?}");
    }
    let (echoed, tries) = echo_through(tunnels, engine, name, 1 << 20).await?;
    Ok(format!(
        "killed {victim_name} (grace 0); replacement {replacement_name} Ready, tunnel Ready again with id {old_id} -> {new_id} after {ready_after:.1?}; \
         Ready seen not True meanwhile: {}; the replacement's restarts {restarts:?}; then 1 MiB through {name} intact in {echoed:.2?} (try {tries})",
        match &not_ready {
            Some((status, at)) => format!("{status} at {at:.1?}"),
            None => "never (sampled every 200 ms)".to_owned(),
        }
    ))
}

/// Bytes the live stream of the engine outage echoes before and after.
const LIVE_BYTES: usize = 64 * 1024;
/// How soon the client must see a live stream end once the engine is killed (the kernel resets
/// its connections at once; generous for a busy machine, the time is reported).
const LIVE_END_LIMIT: Duration = Duration::from_secs(30);

/// Connects to TCP tunnel `name`'s ingress and echoes `len` bytes on that connection (within
/// 30 s), leaving it open.
async fn open_stream(
    tunnels: &Api<RstreamTunnel>,
    engine: &(impl EngineView + ?Sized),
    name: &str,
    len: usize,
) -> anyhow::Result<tokio::net::TcpStream> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let id = (tunnels.get(name).await?.status)
        .and_then(|s| s.tunnel_id)
        .unwrap_or_default();
    let addr = (wait_ingress(engine, &id).await)
        .with_context(|| format!("the engine has no ingress for tunnel {id:?}"))?;
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream.write_all(&data).await?;
        let mut back = vec![0; len];
        stream.read_exact(&mut back).await?;
        anyhow::Ok((stream, back))
    };
    let (stream, back) = tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .with_context(|| format!("no echo of {len} bytes through {addr} within 30 s"))??;
    if back != data {
        bail!("the echo through {addr} differs");
    }
    Ok(stream)
}

/// Reads until the stream ends; returns when, and how: EOF or the error (with any bytes that
/// came after the echo).
async fn stream_end(mut read: tokio::net::tcp::OwnedReadHalf) -> (Instant, String) {
    use tokio::io::AsyncReadExt as _;
    let mut buf = vec![0; 16 * 1024];
    let mut extra = 0;
    loop {
        match read.read(&mut buf).await {
            Ok(0) => {
                return (
                    Instant::now(),
                    format!("EOF ({extra} unexpected bytes first)"),
                );
            }
            Ok(n) => extra += n,
            Err(e) => {
                return (
                    Instant::now(),
                    format!("error {e} ({extra} unexpected bytes first)"),
                );
            }
        }
    }
}

/// How long the rotation may take: the Secret change to both agents on the new token.
const ROTATION_LIMIT: Duration = Duration::from_secs(180);
/// How long an engine outage's effects (conditions, logins, Ready) may take to show.
const OUTAGE_LIMIT: Duration = Duration::from_secs(90);

/// Waits until `engine` has at least `count` open control channels and every open one logged in
/// with `token`; returns when and the logins.
async fn wait_logins(
    engine: &EngineProcess,
    token: &str,
    count: usize,
    limit: Duration,
) -> anyhow::Result<(Duration, String)> {
    let started = Instant::now();
    loop {
        let logins = engine.logins();
        let open: Vec<&Login> = logins.iter().filter(|l| l.open).collect();
        if open.len() >= count && open.iter().all(|l| l.token == token) {
            return Ok((started.elapsed(), logins_text(&logins)));
        }
        if started.elapsed() > limit {
            bail!(
                "within {limit:?}, not {count} open control channels all with token {token}: logins {}",
                logins_text(&logins)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Rotates the token: the engine accepts [`TOKEN`] and [`TOKEN_2`], the Secret changes to
/// [`TOKEN_2`], both agents (web and echo) roll and log in with it; then the engine revokes
/// [`TOKEN`] and a login of our own with it must be refused. Returns the detail and the index of
/// the first login after the revocation.
async fn rotate_token(
    tunnels: &Api<RstreamTunnel>,
    deployments: &Api<Deployment>,
    secrets: &Api<Secret>,
    engine: &mut EngineProcess,
) -> anyhow::Result<(String, usize)> {
    let agent = tunnels
        .get("web")
        .await?
        .status
        .and_then(|s| s.agent_deployment)
        .context("no agent Deployment in the status")?;
    let hash = |d: &Deployment| {
        d.spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.annotations.as_ref())
            .and_then(|a| a.get(names::CONFIG_HASH_ANNOTATION))
            .cloned()
            .unwrap_or_default()
    };
    let before = hash(&deployments.get(&agent).await?);
    let before_logins = engine.logins();
    if before_logins.iter().any(|l| l.open && l.token != TOKEN) {
        bail!(
            "before the rotation a channel is open without token {TOKEN}: {}",
            logins_text(&before_logins)
        );
    }
    engine.set_tokens(&[TOKEN, TOKEN_2]).await?;
    let mark = before_logins.len();
    secrets
        .patch(
            "rstream-credentials",
            &PatchParams::default(),
            &Patch::Merge(json!({ "stringData": { "token": TOKEN_2 } })),
        )
        .await?;
    let started = Instant::now();
    // Both agents on the new token: each open channel logged in with it (the old agents' channels
    // closed as their Pods went), and both tunnels Ready.
    loop {
        let logins = engine.logins();
        let open: Vec<&Login> = logins.iter().filter(|l| l.open).collect();
        let switched = open.len() >= 2 && open.iter().all(|l| l.token == TOKEN_2);
        if switched
            && condition(&tunnels.get("web").await?, "Ready").is_some_and(|(s, _, _)| s == "True")
            && condition(&tunnels.get("echo").await?, "Ready").is_some_and(|(s, _, _)| s == "True")
        {
            break;
        }
        if started.elapsed() > ROTATION_LIMIT {
            bail!(
                "within {ROTATION_LIMIT:?} of the Secret change the agents are not both on the new token: logins since the change {}; open channels {}",
                logins_text(&logins[mark..]),
                logins_text(&open.into_iter().cloned().collect::<Vec<_>>())
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let switched = started.elapsed();
    // Revoked: the engine refuses the old token from now on and closes any channel on it.
    let revoked_at = engine.logins().len();
    engine.set_tokens(&[TOKEN_2]).await?;
    let probe = rstream_client::Client::builder()
        .engine(engine.engine_address())
        .token(TOKEN)
        .tls(TlsOptions::new().ca_pem(engine.ca_pem().into_bytes()))
        .operation_timeout(Duration::from_secs(30))
        .connect_timeout(Duration::from_secs(30))
        .build()?
        .connect()
        .await;
    let probe = match probe {
        Err(err) if err.engine_code() == Some(rstream_client::EngineErrorCode::Unauthorized) => {
            format!("a login of ours with the old token refused ({err})")
        }
        Err(err) => {
            bail!("a login with the old token after the revocation failed otherwise: {err}")
        }
        Ok(control) => {
            let _ = control.close().await;
            bail!("the engine let a login with the revoked token {TOKEN} in");
        }
    };
    // The agents were restarted by the operator: the Deployment's config hash moved and it rolled.
    let after = hash(&deployments.get(&agent).await?);
    if after == before {
        bail!("both agents use the new token, yet the config hash stayed {before}");
    }
    let d = deployments.get(&agent).await?;
    let generation = d.metadata.generation.unwrap_or(0);
    let status = d.status.unwrap_or_default();
    if status.observed_generation != Some(generation) || status.updated_replicas != Some(1) {
        bail!("the agent Deployment {agent} has not rolled out: {status:?}");
    }
    Ok((
        format!(
            "config hash {before} -> {after}; both agents on {TOKEN_2} {switched:.1?} after the Secret changed (logins since: {}); {TOKEN} revoked, {probe}",
            logins_text(&engine.logins()[mark..])
        ),
        revoked_at,
    ))
}

/// After the revocation of [`TOKEN`]: no login with it was let in, and the open channels (at
/// least the two agents') all carry [`TOKEN_2`].
fn after_revocation(engine: &EngineProcess, revoked_at: usize) -> anyhow::Result<String> {
    let logins = engine.logins();
    let since = &logins[revoked_at.min(logins.len())..];
    if let Some(l) = since.iter().find(|l| l.accepted && l.token == TOKEN) {
        bail!(
            "after the revocation the engine let {l} in: {}",
            logins_text(since)
        );
    }
    let open: Vec<Login> = logins.iter().filter(|l| l.open).cloned().collect();
    if open.len() < 2 || open.iter().any(|l| l.token != TOKEN_2) {
        bail!(
            "after the revocation the open channels are {} (want both agents on {TOKEN_2})",
            logins_text(&open)
        );
    }
    Ok(format!(
        "after the revocation: open channels {}, logins {}",
        logins_text(&open),
        logins_text(since)
    ))
}

async fn delete_tunnel(
    env: &Env<'_>,
    tunnels: &Api<RstreamTunnel>,
    ns: &str,
    name: &str,
) -> anyhow::Result<String> {
    let client = env.plane.client().await?;
    let t = tunnels.get(name).await?;
    let base = names::base_name(ns, name, t.metadata.uid.as_deref());
    tunnels.delete(name, &DeleteParams::default()).await?;
    let started = Instant::now();
    loop {
        let mut left = Vec::new();
        if tunnels.get_opt(name).await?.is_some() {
            left.push(format!("RstreamTunnel {name}"));
        }
        if Api::<Deployment>::namespaced(client.clone(), ns)
            .get_opt(&base)
            .await?
            .is_some()
        {
            left.push("Deployment".to_owned());
        }
        if Api::<ServiceAccount>::namespaced(client.clone(), ns)
            .get_opt(&base)
            .await?
            .is_some()
        {
            left.push("ServiceAccount".to_owned());
        }
        if Api::<Role>::namespaced(client.clone(), ns)
            .get_opt(&base)
            .await?
            .is_some()
        {
            left.push("Role".to_owned());
        }
        if Api::<RoleBinding>::namespaced(client.clone(), ns)
            .get_opt(&base)
            .await?
            .is_some()
        {
            left.push("RoleBinding".to_owned());
        }
        if Api::<ConfigMap>::namespaced(client.clone(), ns)
            .get_opt(&format!("{base}-config"))
            .await?
            .is_some()
        {
            left.push("ConfigMap".to_owned());
        }
        let pods = Api::<Pod>::namespaced(client.clone(), ns)
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|p| {
                p.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with(&base))
            })
            .count();
        if pods > 0 {
            left.push(format!("{pods} agent Pods"));
        }
        if left.is_empty() {
            return Ok(format!("all gone after {:.1?}", started.elapsed()));
        }
        if started.elapsed() > Duration::from_secs(90) {
            bail!("after 90 s still there: {}", left.join(", "));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_scenario_list_names_each_scenario_once() {
        let names = super::expected_scenarios();
        let unique: std::collections::BTreeSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "{names:#?}");
        assert_eq!(names.len(), 13);
    }
}
