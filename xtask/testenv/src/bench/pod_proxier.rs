//! `bench pod-proxier`: V1 mappings through pod-proxier against a real etcd + kube-apiserver, with
//! its embedded data plane and with a real HAProxy driven through its Runtime API. Measured: the
//! time from `POST /api/v1/mapping` to the first byte from the pod through the new mapping, and
//! bulk throughput through a mapping versus straight to the "pod" (a loopback sink). POST to
//! first byte is measured with `--auth none` and with `--auth kubernetes` (a ServiceAccount token
//! checked with TokenReview, access with SubjectAccessReview, as the chart runs it).
//!
//! Both pod-proxier processes and HAProxy run on the relay CPU; the throughput generator and sink
//! run on a thread pinned to the generator CPU.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{ControlPlane, Identity};
use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::CustomResourceExt as _;
use kube::api::{Api, Patch, PatchParams, PostParams};
use pod_proxier::crd::PortMapping;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::load::{self, Direction, Sink};
use super::report::{Metric, Recorder, notes_from};
use super::system::{self, GENERATOR_CPU, RELAY_CPU};
use super::{Outcome, Settings};

const DIRECT: &str = "direct";
const EMBEDDED: &str = "pod-proxier embedded, --auth none";
const HAPROXY: &str = "pod-proxier + HAProxy splice-auto, --auth none";
const EMBEDDED_AUTH: &str = "pod-proxier embedded, --auth kubernetes";
const HAPROXY_AUTH: &str = "pod-proxier + HAProxy splice-auto, --auth kubernetes";
/// The ServiceAccount whose token the authenticated contenders' requests carry.
const CALLER: &str = "mapper";

const FIRST_BYTE: Metric = Metric::lower(
    "POST to first byte through the new mapping, per mapping",
    "ms",
);
const FIRST_BYTE_P99: Metric =
    Metric::lower("POST to first byte through the new mapping, p99", "ms");
const DOWNLOAD: Metric = Metric::higher("1 stream through the mapping, download", "Gbit/s");
const UPLOAD: Metric = Metric::higher("1 stream through the mapping, upload", "Gbit/s");

/// The container port name pod-proxier maps by default.
const PORT_NAME: &str = "jprofiler-port";
/// Mappings cycle through this many pods, so every POST points the entry port somewhere new.
const BANNER_PODS: usize = 4;
const TTL_SECONDS: u64 = 3600;
/// The longest one mapping, one idle check or one API call may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

struct Sizes {
    mappings: usize,
    bulk_bytes: u64,
}

impl Sizes {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                mappings: 20,
                bulk_bytes: 16 << 20,
            }
        } else {
            Self {
                mappings: 200,
                bulk_bytes: 256 << 20,
            }
        }
    }
}

pub fn run(settings: &Settings) -> anyhow::Result<Outcome> {
    let binary = system::cargo_build_release(&["-p", "pod-proxier", "--bin", "pod-proxier"])?;
    let haproxy =
        system::which("haproxy").context("HAProxy is required (apt-get install haproxy)")?;
    let sizes = Sizes::new(settings.quick);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let recorder = runtime.block_on(async {
        eprintln!("pod-proxier: starting etcd and kube-apiserver");
        let plane = ControlPlane::builder().start().await?;
        let recorder = measure(settings, &sizes, &plane, &binary, &haproxy).await;
        plane.stop();
        recorder
    })?;
    Ok(Outcome {
        figures: recorder.finish(&[DIRECT, EMBEDDED]),
        goals: Vec::new(),
        notes: notes(settings, &sizes),
    })
}

/// The report's prose: `pod_proxier_notes.md` with this run's settings.
const NOTES_TEMPLATE: &str = include_str!("pod_proxier_notes.md");

fn note_values(settings: &Settings, sizes: &Sizes) -> Vec<(&'static str, String)> {
    vec![
        ("mappings", sizes.mappings.to_string()),
        ("rounds", settings.rounds.to_string()),
        ("banner_pods", BANNER_PODS.to_string()),
        ("bulk_mib", (sizes.bulk_bytes >> 20).to_string()),
        ("caller", CALLER.to_owned()),
    ]
}

fn notes(settings: &Settings, sizes: &Sizes) -> Vec<String> {
    notes_from(NOTES_TEMPLATE, &note_values(settings, sizes))
}

async fn measure(
    settings: &Settings,
    sizes: &Sizes,
    plane: &ControlPlane,
    binary: &Path,
    haproxy: &Path,
) -> anyhow::Result<Recorder> {
    plane.install_crds(&[PortMapping::crd()]).await?;
    let client = plane.client().await?;
    let pods_ns = plane.create_namespace("bench-pods").await?;
    let banners = BannerPods::start(&client, &pods_ns).await?;
    let dir = tempfile::Builder::new()
        .prefix("netkit-bench-pod-proxier-")
        .tempdir()?;

    let token = caller_token(plane, &client, &pods_ns).await?;
    let embedded_ns = plane.create_namespace("bench-embedded").await?;
    let mut embedded = Proxier::prepare(plane, binary, &embedded_ns, &pods_ns, &[], None)?;
    embedded.spawn(dir.path()).await?;
    let (mut with_haproxy, _haproxy) =
        start_with_haproxy(plane, binary, haproxy, &pods_ns, dir.path(), None).await?;
    let authed_ns = plane.create_namespace("bench-embedded-auth").await?;
    let mut embedded_auth =
        Proxier::prepare(plane, binary, &authed_ns, &pods_ns, &[], Some(&token))?;
    embedded_auth.spawn(dir.path()).await?;
    let (mut haproxy_auth, _haproxy_auth) =
        start_with_haproxy(plane, binary, haproxy, &pods_ns, dir.path(), Some(&token)).await?;

    let mut recorder = Recorder::default();
    eprintln!("pod-proxier: {} mappings per backend", sizes.mappings);
    let mut contenders = [
        (EMBEDDED, &mut embedded),
        (HAPROXY, &mut with_haproxy),
        (EMBEDDED_AUTH, &mut embedded_auth),
        (HAPROXY_AUTH, &mut haproxy_auth),
    ];
    let mut millis: [Vec<f64>; 4] = Default::default();
    for round in 0..settings.rounds {
        let count = share(sizes.mappings, settings.rounds, round);
        for index in super::proxy::shuffled(contenders.len()) {
            let (name, proxier) = &mut contenders[index];
            for _ in 0..count {
                let next = banners.next_after(proxier.mapped);
                let elapsed = map_and_time(proxier, &banners, next)
                    .await
                    .with_context(|| format!("mapping through {name}"))?;
                millis[index].push(elapsed.as_secs_f64() * 1e3);
            }
            proxier.check_running()?;
        }
    }
    for (name, mut samples) in [EMBEDDED, HAPROXY, EMBEDDED_AUTH, HAPROXY_AUTH]
        .into_iter()
        .zip(millis)
    {
        for value in &samples {
            recorder.record(FIRST_BYTE, name, *value);
        }
        samples.sort_by(f64::total_cmp);
        recorder.record(FIRST_BYTE_P99, name, percentile(&samples, 0.99));
    }

    eprintln!("pod-proxier: throughput");
    let entries = [
        (EMBEDDED, embedded.clone_addrs()),
        (HAPROXY, with_haproxy.clone_addrs()),
    ];
    tokio::task::block_in_place(|| {
        std::thread::scope(|scope| {
            scope
                .spawn(|| throughput(settings, sizes, plane, &pods_ns, &entries, &mut recorder))
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("the throughput thread panicked")))
        })
    })?;
    embedded.check_running()?;
    with_haproxy.check_running()?;
    embedded_auth.check_running()?;
    haproxy_auth.check_running()?;
    Ok(recorder)
}

/// Each contender's configuration, as the summary shows it.
pub fn contenders(_settings: &Settings) -> Vec<(&'static str, String)> {
    let common = format!("release build, --enable-v1, pinned to CPU {RELAY_CPU}");
    let haproxy = "HAProxy from `pod-proxier haproxy-config` (option splice-auto, tune.pipesize 1 MiB, maxpipes = maxconn 4096) driven through its Runtime API, pinned to the same CPU";
    vec![
        (
            DIRECT,
            "generator to the sink (the pod's podIP:port) on loopback".to_owned(),
        ),
        (
            EMBEDDED,
            format!(
                "{common}, --auth none, embedded proxy-core data plane (automatic copy mode, 1 MiB pipes)"
            ),
        ),
        (
            HAPROXY,
            format!("{common}, --auth none, --backend=haproxy; {haproxy}"),
        ),
        (
            EMBEDDED_AUTH,
            format!(
                "{common}, --auth kubernetes (TokenReview + SubjectAccessReview), embedded data plane"
            ),
        ),
        (
            HAPROXY_AUTH,
            format!(
                "{common}, --auth kubernetes (TokenReview + SubjectAccessReview), --backend=haproxy; {haproxy}"
            ),
        ),
    ]
}

/// The share of `total` that round `round` of `rounds` does (they add up to `total`).
fn share(total: usize, rounds: usize, round: usize) -> usize {
    total * (round + 1) / rounds - total * round / rounds
}

fn percentile(sorted: &[f64], quantile: f64) -> f64 {
    let index = ((sorted.len() as f64 * quantile).ceil() as usize).saturating_sub(1);
    sorted.get(index).copied().unwrap_or(f64::NAN)
}

/// Deletes the current mapping, waits until the entry port is idle, maps pod `next` and times
/// POST to first byte; then checks the greeting is that pod's.
async fn map_and_time(
    proxier: &mut Proxier,
    banners: &BannerPods,
    next: usize,
) -> anyhow::Result<Duration> {
    if let Some(current) = proxier.mapped.take() {
        let path = format!("/api/v1/mapping?pod_name={}", banners.pod_name(current));
        let token = proxier.token.as_deref();
        let (status, body) = http(proxier.api, "DELETE", &path, None, token).await?;
        if status != 200 {
            bail!("DELETE {path} answered {status}: {body}");
        }
    }
    wait_idle(proxier.entry).await?;
    let body = serde_json::json!({"pod_name": banners.pod_name(next), "time": TTL_SECONDS});
    let elapsed = crate::fixtures::post_to_first_byte(
        proxier.api,
        "/api/v1/mapping",
        &body.to_string(),
        proxier.token.as_deref(),
        proxier.entry,
        STEP_TIMEOUT,
    )
    .await?;
    proxier.mapped = Some(next);
    let greeting = greeting(proxier.entry).await;
    if greeting.as_deref() != Some(banners.tag(next).as_str()) {
        bail!(
            "the entry port greets with {greeting:?}, not {}",
            banners.tag(next)
        );
    }
    Ok(elapsed)
}

/// Waits until a connection to `entry` yields no greeting (refused, or closed by HAProxy).
async fn wait_idle(entry: SocketAddr) -> anyhow::Result<()> {
    let deadline = Instant::now() + STEP_TIMEOUT;
    while greeting(entry).await.is_some() {
        if Instant::now() > deadline {
            bail!("{entry} still forwards {STEP_TIMEOUT:?} after the mapping was deleted");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// The first line whoever answers on `addr` sends, or `None` if refused or closed without one.
async fn greeting(addr: SocketAddr) -> Option<String> {
    let read = async {
        let mut stream = TcpStream::connect(addr).await.ok()?;
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while let Ok(1) = stream.read(&mut byte).await {
            if byte[0] == b'\n' {
                break;
            }
            line.push(byte[0]);
        }
        (!line.is_empty()).then(|| String::from_utf8_lossy(&line).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(2), read)
        .await
        .ok()
        .flatten()
}

/// One HTTP/1.1 request over a fresh connection: (status, body).
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    json: Option<&serde_json::Value>,
    token: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    let body = json.map(|j| j.to_string()).unwrap_or_default();
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{authorization}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        anyhow::Ok(String::from_utf8_lossy(&answer).into_owned())
    };
    let text = tokio::time::timeout(STEP_TIMEOUT, exchange)
        .await
        .with_context(|| format!("{method} {path}: no answer within {STEP_TIMEOUT:?}"))??;
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("{method} {path}: not HTTP: {text:?}"))?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Ok((status, body.to_owned()))
}

/// Pods whose podIP:port is a local server that greets with the pod's tag and closes.
struct BannerPods {
    namespace: String,
    servers: Vec<JoinHandle<()>>,
}

impl BannerPods {
    async fn start(client: &kube::Client, namespace: &str) -> anyhow::Result<Self> {
        let mut pods = Self {
            namespace: namespace.to_owned(),
            servers: Vec::new(),
        };
        for i in 0..BANNER_PODS {
            let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
            let port = listener.local_addr()?.port();
            pods.servers
                .push(tokio::spawn(greet(listener, pods.tag(i))));
            create_pod(client, namespace, &format!("pod-{i}"), port).await?;
        }
        Ok(pods)
    }

    fn pod_name(&self, i: usize) -> String {
        format!("{}/pod-{i}", self.namespace)
    }

    fn tag(&self, i: usize) -> String {
        format!("banner-{i}")
    }

    fn next_after(&self, current: Option<usize>) -> usize {
        current.map_or(0, |i| (i + 1) % BANNER_PODS)
    }
}

impl Drop for BannerPods {
    fn drop(&mut self) {
        for server in &self.servers {
            server.abort();
        }
    }
}

async fn greet(listener: TcpListener, tag: String) {
    let greeting = format!("{tag}\n");
    loop {
        let Ok((mut conn, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let greeting = greeting.clone();
        tokio::spawn(async move {
            // The client only needs the greeting; a failed write is its problem to report.
            let _ = conn.write_all(greeting.as_bytes()).await;
        });
    }
}

/// A Running pod with podIP 127.0.0.1 and the mapped container port at `port`.
async fn create_pod(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    port: u16,
) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "app", "image": "example",
            "ports": [{"name": PORT_NAME, "containerPort": port}]}]},
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    let status = serde_json::json!({"status": {
        "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(())
}

/// One pod-proxier process (V1 only) on loopback.
struct Proxier {
    binary: PathBuf,
    /// With a token: `--auth kubernetes`, and requests carry it; without: `--auth none`.
    token: Option<String>,
    args: Vec<String>,
    api: SocketAddr,
    entry: SocketAddr,
    metrics: SocketAddr,
    process: Option<system::Service>,
    /// The banner pod currently mapped.
    mapped: Option<usize>,
}

impl Proxier {
    fn prepare(
        plane: &ControlPlane,
        binary: &Path,
        state_ns: &str,
        pods_ns: &str,
        extra: &[&str],
        token: Option<&str>,
    ) -> anyhow::Result<Self> {
        let address = || -> anyhow::Result<SocketAddr> {
            Ok(SocketAddr::from((
                Ipv4Addr::LOCALHOST,
                system::free_port()?,
            )))
        };
        let (api, entry, metrics) = (address()?, address()?, address()?);
        let mut args: Vec<String> = [
            "--enable-v1",
            if token.is_some() {
                "--auth=kubernetes"
            } else {
                "--auth=none"
            },
            "--listen-addr=127.0.0.1",
            "--api-listen-addr=127.0.0.1",
            // Loopback only, and the same for every round: TLS would only add the handshake.
            "--plain-http",
            "--log-level=warn",
        ]
        .map(str::to_owned)
        .to_vec();
        args.extend([
            format!("--kubeconfig={}", plane.kubeconfig_path().display()),
            format!("--state-namespace={state_ns}"),
            format!("--identity=bench-{state_ns}"),
            format!("--listen-port={}", api.port()),
            format!("--default-map-port={}", entry.port()),
            // One plain-HTTP address for health and metrics: the bench reads both as anyone.
            format!("--health-addr={metrics}"),
            format!("--metrics-addr={metrics}"),
            "--metrics-secure=false".to_owned(),
            format!("--allowed-namespaces={pods_ns}"),
            format!("--max-mapping-time={TTL_SECONDS}"),
        ]);
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        Ok(Self {
            binary: binary.to_owned(),
            token: token.map(str::to_owned),
            args,
            api,
            entry,
            metrics,
            process: None,
            mapped: None,
        })
    }

    /// The HAProxy configuration `pod-proxier haproxy-config` prints for these flags.
    fn haproxy_config(&self) -> anyhow::Result<String> {
        let output = Command::new(&self.binary)
            .arg("haproxy-config")
            .args(&self.args)
            .output()
            .context("running pod-proxier haproxy-config")?;
        if !output.status.success() {
            bail!(
                "pod-proxier haproxy-config failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8(output.stdout)?)
    }

    async fn spawn(&mut self, log_dir: &Path) -> anyhow::Result<()> {
        let mut cmd = system::pinned_command(RELAY_CPU, &self.binary);
        cmd.args(&self.args).env_remove("KUBECONFIG");
        let name = format!("pod-proxier-{}", self.entry.port());
        self.process = Some(system::Service::spawn(&name, cmd, log_dir)?);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.check_running()?;
            if let Ok((200, _)) = http(self.metrics, "GET", "/readyz", None, None).await {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("pod-proxier was not ready within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn check_running(&mut self) -> anyhow::Result<()> {
        match &mut self.process {
            Some(process) => process.check_running(),
            None => bail!("pod-proxier was not started"),
        }
    }

    fn clone_addrs(&self) -> (SocketAddr, SocketAddr) {
        (self.api, self.entry)
    }
}

/// HAProxy with the configuration of `pod-proxier haproxy-config`, then pod-proxier driving it
/// through the Runtime API socket.
async fn start_with_haproxy(
    plane: &ControlPlane,
    binary: &Path,
    haproxy: &Path,
    pods_ns: &str,
    dir: &Path,
    token: Option<&str>,
) -> anyhow::Result<(Proxier, system::Service)> {
    let state_ns = plane
        .create_namespace(if token.is_some() {
            "bench-haproxy-auth"
        } else {
            "bench-haproxy"
        })
        .await?;
    let socket = dir.join(format!("haproxy-admin-{state_ns}.sock"));
    let api_addr = format!("unix://{}", socket.display());
    let mut proxier = Proxier::prepare(
        plane,
        binary,
        &state_ns,
        pods_ns,
        &["--backend=haproxy", &format!("--api-addr={api_addr}")],
        token,
    )?;
    let config = dir.join(format!("haproxy-{state_ns}.cfg"));
    std::fs::write(&config, proxier.haproxy_config()?)?;
    let mut cmd = system::pinned_command(RELAY_CPU, haproxy);
    cmd.args(["-db", "-f"]).arg(&config);
    let mut haproxy = system::Service::spawn(&format!("haproxy-{state_ns}"), cmd, dir)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        haproxy.check_running()?;
        if Instant::now() > deadline {
            bail!("HAProxy's admin socket did not appear within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxier.spawn(dir).await?;
    Ok((proxier, haproxy))
}

/// A ServiceAccount token (from the TokenRequest API) allowed to map the pods of `pods_ns`.
async fn caller_token(
    plane: &ControlPlane,
    client: &kube::Client,
    pods_ns: &str,
) -> anyhow::Result<String> {
    let role: Role = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "mapper"},
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
            {"apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["create"]},
        ],
    }))?;
    Api::<Role>::namespaced(client.clone(), pods_ns)
        .create(&PostParams::default(), &role)
        .await?;
    let binding: RoleBinding = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "mapper"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "mapper"},
        "subjects": [{"kind": "ServiceAccount", "name": CALLER, "namespace": pods_ns}],
    }))?;
    Api::<RoleBinding>::namespaced(client.clone(), pods_ns)
        .create(&PostParams::default(), &binding)
        .await?;
    let kubeconfig = plane
        .kubeconfig_as(&Identity::service_account(pods_ns, CALLER))
        .await?;
    let text = std::fs::read_to_string(&kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    let value: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text)?;
    value["users"][0]["user"]["token"]
        .as_str()
        .map(str::to_owned)
        .context("no token in the ServiceAccount's kubeconfig")
}

/// Runs on its own thread, pinned to the generator CPU, with its own runtime (the sink's tasks
/// must run there too).
fn throughput(
    settings: &Settings,
    sizes: &Sizes,
    plane: &ControlPlane,
    pods_ns: &str,
    entries: &[(&str, (SocketAddr, SocketAddr))],
    recorder: &mut Recorder,
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    system::with_cpu(GENERATOR_CPU, || {
        runtime.block_on(async {
            let sink = Sink::start().await?;
            let client = plane.client().await?;
            create_pod(&client, pods_ns, "bulk", sink.addr().port()).await?;
            let mut contenders = vec![(DIRECT, sink.addr())];
            for (name, (api, entry)) in entries {
                map_bulk_pod(*api, *entry, pods_ns)
                    .await
                    .with_context(|| format!("mapping the bulk pod through {name}"))?;
                contenders.push((name, *entry));
            }
            for (direction, metric) in
                [(Direction::Download, DOWNLOAD), (Direction::Upload, UPLOAD)]
            {
                for _ in 0..settings.rounds {
                    for (name, addr) in &contenders {
                        let elapsed = load::bulk(*addr, direction, 1, sizes.bulk_bytes)
                            .await
                            .with_context(|| format!("{} through {name}", metric.name))?;
                        let gbits = sizes.bulk_bytes as f64 * 8.0 / elapsed.as_secs_f64() / 1e9;
                        recorder.record(metric, name, gbits);
                    }
                }
            }
            anyhow::Ok(())
        })
    })?
}

/// Maps the bulk pod and waits until a small transfer passes (the sink does not greet).
async fn map_bulk_pod(api: SocketAddr, entry: SocketAddr, pods_ns: &str) -> anyhow::Result<()> {
    let body = serde_json::json!({"pod_name": format!("{pods_ns}/bulk"), "time": TTL_SECONDS});
    let (status, answer) = http(api, "POST", "/api/v1/mapping", Some(&body), None).await?;
    if status != 200 {
        bail!("POST /api/v1/mapping answered {status}: {answer}");
    }
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        match load::bulk(entry, Direction::Download, 1, 1 << 20).await {
            Ok(_) => return Ok(()),
            Err(error) if Instant::now() > deadline => return Err(error),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}
