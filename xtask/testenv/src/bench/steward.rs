//! `bench steward`: how fast steward-tcp-proxy repairs edits of the `default/kubernetes`
//! EndpointSlice, next to a re-creation of the seed's reconciler (get, compare, update on a 30 s
//! ticker) run against the same API server and timed the same way; and API server LIST throughput
//! through steward's relay versus straight to the API server. Runs against a real etcd +
//! kube-apiserver started with `--endpoint-reconciler-type=none`.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::ControlPlane;
use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher;
use tokio::sync::mpsc;

use super::report::{Metric, Recorder, notes_from};
use super::system::{self, RELAY_CPU};
use super::{Outcome, Settings};

const DIRECT: &str = "direct";
const STEWARD: &str = "steward-tcp-proxy";
const SEED: &str = "seed: 30 s poll (re-created in the bench)";

const REPAIR: Metric = Metric::lower("drift repair latency, per edit", "ms");
const REPAIR_P99: Metric = Metric::lower("drift repair latency, p99", "ms");
const LIST: Metric = Metric::higher("LIST of ConfigMaps over TLS (response bytes)", "MiB/s");
const RELAY_CPU_PER_GIB: Metric = Metric::lower("relay CPU per GiB of LIST responses", "CPU s/GiB");
const FIRST_PUBLISH: Metric = Metric::lower("first publish after the Lease names the leader", "ms");
/// The goal for [`FIRST_PUBLISH`] (the bound a correctness test used to hold on a busy machine).
const FIRST_PUBLISH_GOAL_MS: f64 = 1_000.0;

/// The seed's `--reconcile-interval` default: it reconciles once at start, then on this ticker.
const SEED_POLL: Duration = Duration::from_secs(30);
/// The seed's managed-by label value.
const SEED_MANAGER: &str = "steward-tcp-proxy";
/// The binary treats 60 foreign repairs a minute as a fight; stay below.
const EDIT_SPACING: Duration = Duration::from_millis(1_100);
const SERVICE_PORT: i32 = 6443;

struct Sizes {
    /// Edits repaired by steward, spread over the rounds.
    edits: usize,
    /// Edits repaired by the seed poller, spread over the rounds (each costs about 30 s).
    seed_edits: usize,
    config_maps: usize,
    lists_per_round: usize,
}

impl Sizes {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                edits: 5,
                seed_edits: 2,
                config_maps: 5,
                lists_per_round: 3,
            }
        } else {
            Self {
                edits: 50,
                seed_edits: 6,
                config_maps: 20,
                lists_per_round: 10,
            }
        }
    }
}

pub fn run(settings: &Settings) -> anyhow::Result<Outcome> {
    let binary =
        system::cargo_build_release(&["-p", "steward-tcp-proxy", "--bin", "steward-tcp-proxy"])?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        eprintln!("steward: starting etcd and kube-apiserver");
        let plane = ControlPlane::builder()
            .apiserver_arg("--endpoint-reconciler-type=none")
            .start()
            .await?;
        let outcome = measure(settings, &plane, &binary).await;
        plane.stop();
        outcome
    })
}

async fn measure(
    settings: &Settings,
    plane: &ControlPlane,
    binary: &Path,
) -> anyhow::Result<Outcome> {
    let sizes = Sizes::new(settings.quick);
    let client = plane.client().await?;
    let namespace = plane.create_namespace("bench").await?;
    let cluster_ip = create_proxy_service(&client, &namespace).await?;
    let dir = tempfile::Builder::new()
        .prefix("netkit-bench-steward-")
        .tempdir()?;
    let expected = vec![cluster_ip];

    let mut recorder = Recorder::default();
    let mut repairs: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    let mut steward_metrics = Vec::new();
    eprintln!(
        "steward: {} edits repaired by steward and {} by the seed poller, over {} rounds",
        sizes.edits, sizes.seed_edits, settings.rounds
    );
    for round in 0..settings.rounds {
        for index in super::proxy::shuffled(2) {
            if index == 0 {
                let count = share(sizes.edits, settings.rounds, round);
                if count == 0 {
                    continue;
                }
                let mut steward = Steward::start(plane, binary, &namespace, dir.path())?;
                wait_published(&client, &expected).await?;
                let timing = EditTiming::Spaced(EDIT_SPACING);
                let measured = drift_repairs(&client, &expected, count, timing).await?;
                steward.process.check_running()?;
                steward_metrics.push((
                    steward.metric("steward_endpoint_repairs_total").await,
                    steward.metric("steward_endpoint_fight").await,
                ));
                repairs[0].extend(measured);
            } else {
                let count = share(sizes.seed_edits, settings.rounds, round);
                if count == 0 {
                    continue;
                }
                let poller = SeedPoller::start(client.clone(), &namespace);
                wait_published(&client, &expected).await?;
                let timing = EditTiming::RandomPhase(SEED_POLL);
                let measured = drift_repairs(&client, &expected, count, timing).await;
                let reconciles = poller.stop();
                repairs[1].extend(measured?);
                eprintln!("steward: seed poller reconciled {reconciles} times");
            }
        }
    }
    record_repairs(&mut recorder, STEWARD, &repairs[0]);
    record_repairs(&mut recorder, SEED, &repairs[1]);
    let mut first_publishes = Vec::new();
    for _ in 0..settings.rounds {
        let took = first_publish(&client, plane, binary, &namespace, dir.path(), &expected).await?;
        recorder.record(FIRST_PUBLISH, STEWARD, took.as_secs_f64() * 1e3);
        first_publishes.push(took.as_secs_f64() * 1e3);
    }
    let slowest_first = first_publishes.iter().copied().fold(0.0, f64::max);
    let mut steward = Steward::start(plane, binary, &namespace, dir.path())?;
    wait_published(&client, &expected).await?;

    eprintln!("steward: LIST throughput");
    let mut throughput = Recorder::default();
    create_config_maps(&client, &namespace, sizes.config_maps).await?;
    let through_steward = client_via(plane, steward.listen).await?;
    let contenders = [
        (DIRECT, &client, None),
        (STEWARD, &through_steward, Some(&steward)),
    ];
    let path = format!("/api/v1/namespaces/{namespace}/configmaps");
    let mut cpu_seconds = 0.0;
    let mut relayed_bytes = 0.0;
    for _ in 0..settings.rounds {
        for (name, client, relay) in &contenders {
            let cpu_before = relay
                .map(|r| system::cpu_seconds(r.process.pid()))
                .transpose()?;
            let (bytes, elapsed) = timed_lists(client, &path, sizes.lists_per_round).await?;
            throughput.record(
                LIST,
                name,
                bytes as f64 / elapsed.as_secs_f64() / f64::from(1u32 << 20),
            );
            if let (Some(relay), Some(before)) = (relay, cpu_before) {
                cpu_seconds += system::cpu_seconds(relay.process.pid())? - before;
                relayed_bytes += bytes as f64;
            }
        }
    }
    if cpu_seconds >= system::MIN_CPU_SECONDS {
        let gib = relayed_bytes / f64::from(1u32 << 30);
        throughput.record(RELAY_CPU_PER_GIB, STEWARD, cpu_seconds / gib);
    } else {
        throughput.note(RELAY_CPU_PER_GIB, STEWARD, "too little CPU time to resolve");
    }
    throughput.note(RELAY_CPU_PER_GIB, DIRECT, "no relay process");
    steward.process.check_running()?;

    let mut figures = recorder.finish(&[SEED]);
    let metrics: Vec<String> = steward_metrics
        .iter()
        .map(|(repairs, fight)| format!("repairs_total {repairs}, fight {fight}"))
        .collect();
    figures.extend(throughput.finish(&[DIRECT]));
    Ok(Outcome {
        figures,
        goals: vec![super::report::Goal {
            goal: format!(
                "{} <= {FIRST_PUBLISH_GOAL_MS} ms (--leader-elect, the slice made wrong before)",
                FIRST_PUBLISH.name
            ),
            measured: format!(
                "{slowest_first:.0} ms at most over {} round(s)",
                first_publishes.len()
            ),
            met: Some(!first_publishes.is_empty() && slowest_first <= FIRST_PUBLISH_GOAL_MS).into(),
        }],
        notes: notes_from(
            NOTES_TEMPLATE,
            &[
                ("rounds", settings.rounds.to_string()),
                ("edits", sizes.edits.to_string()),
                ("edit_spacing", format!("{EDIT_SPACING:?}")),
                ("metrics", metrics.join("; ")),
                ("seed_poll", format!("{SEED_POLL:?}")),
                ("service_port", SERVICE_PORT.to_string()),
                ("seed_edits", sizes.seed_edits.to_string()),
                ("config_maps", sizes.config_maps.to_string()),
                ("lists_per_round", sizes.lists_per_round.to_string()),
                ("relay_cpu", RELAY_CPU.to_string()),
            ],
        ),
    })
}

/// The report's prose, filled with this run's settings.
const NOTES_TEMPLATE: &str = include_str!("steward_notes.md");

/// Each contender's configuration, as the summary shows it.
pub fn contenders(_settings: &Settings) -> Vec<(&'static str, String)> {
    vec![
        (
            DIRECT,
            "kube client straight to kube-apiserver over TLS (kept-alive connection)".to_owned(),
        ),
        (
            STEWARD,
            format!(
                "release build, --endpoint-mode=cluster-ip, watches default/kubernetes, TLS passthrough relay pinned to CPU {RELAY_CPU}, RUST_LOG=warn"
            ),
        ),
        (
            SEED,
            format!(
                "the seed's reconciler re-created in xtask (not its Go binary): once at start, then every {SEED_POLL:?} on a fixed ticker, get Service + get slice, match check, Update in place; same API server, admin client"
            ),
        ),
    ]
}

fn record_repairs(recorder: &mut Recorder, contender: &str, repairs: &[Duration]) {
    let mut millis: Vec<f64> = repairs.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    for value in &millis {
        recorder.record(REPAIR, contender, *value);
    }
    millis.sort_by(f64::total_cmp);
    let p99_index = ((millis.len() as f64 * 0.99).ceil() as usize).saturating_sub(1);
    if let Some(p99) = millis.get(p99_index) {
        recorder.record(REPAIR_P99, contender, *p99);
    }
}

/// The share of `total` that round `round` of `rounds` does (they add up to `total`).
fn share(total: usize, rounds: usize, round: usize) -> usize {
    total * (round + 1) / rounds - total * round / rounds
}

/// A uniformly random fraction in `[0, 1)`.
fn random_fraction() -> f64 {
    use std::hash::{BuildHasher as _, RandomState};
    let bits = RandomState::new().hash_one(Instant::now()) >> 11;
    bits as f64 / (1u64 << 53) as f64
}

/// The seed's reconciler, re-created for the bench (see `shared/reference/steward-tcp-proxy.md`
/// section 3.2): once at start, then on a fixed ticker with no jitter and no watch. A failed pass
/// (e.g. a Conflict) waits for the next tick, as the seed's did.
struct SeedPoller {
    task: tokio::task::JoinHandle<()>,
    reconciles: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl SeedPoller {
    fn start(client: kube::Client, namespace: &str) -> Self {
        let namespace = namespace.to_owned();
        let reconciles = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = reconciles.clone();
        let task = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(SEED_POLL);
            // Go's ticker drops ticks a slow receiver missed.
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                ticker.tick().await;
                if let Err(error) = seed_reconcile(&client, &namespace).await {
                    eprintln!("steward: seed poller: {error:#} (retried at the next tick)");
                }
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
        Self { task, reconciles }
    }

    /// Stops the poller; returns how many passes it made.
    fn stop(self) -> usize {
        self.task.abort();
        self.reconciles.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// One pass of the seed: get the ClusterIP, get the slice, create it or update it in place when
/// the match check fails.
async fn seed_reconcile(client: &kube::Client, namespace: &str) -> anyhow::Result<()> {
    let service = Api::<Service>::namespaced(client.clone(), namespace)
        .get("proxy")
        .await?;
    let cluster_ip = service
        .spec
        .and_then(|spec| spec.cluster_ip)
        .filter(|ip| !ip.is_empty() && ip != "None")
        .context("the proxy Service has no ClusterIP")?;
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let endpoints = serde_json::json!([{
        "addresses": [cluster_ip],
        "conditions": {"ready": true, "serving": true, "terminating": false},
    }]);
    let ports = serde_json::json!([{"name": "https", "port": SERVICE_PORT, "protocol": "TCP"}]);
    let Some(mut slice) = slices.get_opt("kubernetes").await? else {
        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "kubernetes", "labels": {
                "kubernetes.io/service-name": "kubernetes",
                "endpointslice.kubernetes.io/managed-by": SEED_MANAGER,
            }},
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": ports,
        }))?;
        slices.create(&PostParams::default(), &slice).await?;
        return Ok(());
    };
    if seed_matches(&slice, &cluster_ip) {
        return Ok(());
    }
    slice.endpoints = serde_json::from_value(endpoints)?;
    slice.ports = serde_json::from_value(ports)?;
    slice.metadata.labels.get_or_insert_default().insert(
        "endpointslice.kubernetes.io/managed-by".to_owned(),
        SEED_MANAGER.to_owned(),
    );
    slices
        .replace("kubernetes", &PostParams::default(), &slice)
        .await?;
    Ok(())
}

/// The seed's match check: one endpoint, one address equal to the ClusterIP, one port equal to
/// the service port; everything else is ignored.
fn seed_matches(slice: &EndpointSlice, cluster_ip: &str) -> bool {
    let [endpoint] = slice.endpoints.as_deref().unwrap_or_default() else {
        return false;
    };
    let [port] = slice.ports.as_deref().unwrap_or_default() else {
        return false;
    };
    endpoint.addresses.len() == 1
        && endpoint.addresses[0] == cluster_ip
        && port.port == Some(SERVICE_PORT)
}

/// The steward-tcp-proxy child process, pinned to the relay CPU.
struct Steward {
    process: system::Service,
    listen: SocketAddr,
    metrics: SocketAddr,
}

impl Steward {
    fn start(
        plane: &ControlPlane,
        binary: &Path,
        namespace: &str,
        log_dir: &Path,
    ) -> anyhow::Result<Self> {
        let mut steward = Self::spawn(plane, binary, namespace, log_dir, &[])?;
        steward
            .process
            .wait_listening(steward.listen, Duration::from_secs(30))?;
        Ok(steward)
    }

    /// Started with `extra` flags, not waited for.
    fn spawn(
        plane: &ControlPlane,
        binary: &Path,
        namespace: &str,
        log_dir: &Path,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let address = || -> anyhow::Result<SocketAddr> {
            Ok(SocketAddr::from((
                Ipv4Addr::LOCALHOST,
                system::free_port()?,
            )))
        };
        let (listen, health, metrics) = (address()?, address()?, address()?);
        let upstream = plane.server_url().trim_start_matches("https://").to_owned();
        let mut cmd = system::pinned_command(RELAY_CPU, binary);
        cmd.arg(format!(
            "--kubeconfig={}",
            plane.kubeconfig_path().display()
        ))
        .arg(format!("--upstream-addr={upstream}"))
        .arg(format!("--listen-addr={listen}"))
        .arg(format!("--health-addr={health}"))
        .arg(format!("--metrics-addr={metrics}"))
        // Sampled as plain HTTP: the bench is about relaying, not who may scrape.
        .arg("--metrics-secure=false")
        .arg(format!("--service-namespace={namespace}"))
        .arg("--service-name=proxy")
        .arg("--endpoint-mode=cluster-ip")
        .arg(format!("--service-port={SERVICE_PORT}"))
        .args(extra)
        .env_remove("KUBECONFIG")
        .env("RUST_LOG", "warn");
        let process = system::Service::spawn("steward-tcp-proxy", cmd, log_dir)?;
        Ok(Self {
            process,
            listen,
            metrics,
        })
    }

    /// One sample of the metrics endpoint, as text ("?" if unavailable).
    async fn metric(&self, name: &str) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let fetch = async {
            let mut stream = tokio::net::TcpStream::connect(self.metrics).await.ok()?;
            let request = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
            stream.write_all(request.as_bytes()).await.ok()?;
            let mut response = String::new();
            stream.read_to_string(&mut response).await.ok()?;
            response.lines().find_map(|line| {
                let (key, value) = line.split_once(' ')?;
                (key == name).then(|| value.to_owned())
            })
        };
        tokio::time::timeout(Duration::from_secs(5), fetch)
            .await
            .ok()
            .flatten()
            .unwrap_or_else(|| "?".to_owned())
    }
}

/// With the slice made wrong and no Lease, starts steward with `--leader-elect`; returns the time
/// from the first sight of the Lease naming it to the first sight of the slice right again
/// (both polled every 5 ms, so each is seen within a poll of happening).
async fn first_publish(
    client: &kube::Client,
    plane: &ControlPlane,
    binary: &Path,
    namespace: &str,
    log_dir: &Path,
    expected: &[String],
) -> anyhow::Result<Duration> {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let wrong = serde_json::json!({"endpoints": [{"addresses": ["10.0.0.254"]}]});
    slices
        .patch("kubernetes", &PatchParams::default(), &Patch::Merge(&wrong))
        .await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let _ = leases.delete("proxy", &Default::default()).await;
    let flags = ["--leader-elect", "--identity=bench-leader"];
    let mut steward = Steward::spawn(plane, binary, namespace, log_dir, &flags)?;
    let (deadline, mut leading) = (Instant::now() + Duration::from_secs(30), None);
    loop {
        let now = Instant::now();
        let lease = leases
            .get_opt("proxy")
            .await?
            .and_then(|l| l.spec?.holder_identity);
        if leading.is_none() && lease.as_deref() == Some("bench-leader") {
            leading = Some(now);
        }
        if let Some(since) = leading
            && slices
                .get_opt("kubernetes")
                .await?
                .is_some_and(|s| is_repaired(&s, expected))
        {
            steward.process.terminate(Duration::from_secs(10))?;
            return Ok(Instant::now().duration_since(since));
        }
        steward.process.check_running()?;
        if now > deadline {
            bail!("steward did not lead and publish within 30 s (leading: {leading:?})");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The steward's own Service; its ClusterIP is what `default/kubernetes` must point at.
async fn create_proxy_service(client: &kube::Client, namespace: &str) -> anyhow::Result<String> {
    let service: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "proxy", "namespace": namespace},
        "spec": {"ports": [{"name": "https", "port": SERVICE_PORT, "targetPort": 16443}]},
    }))?;
    let created = Api::<Service>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &service)
        .await?;
    created
        .spec
        .and_then(|spec| spec.cluster_ip)
        .context("the proxy Service got no ClusterIP")
}

/// Whether the slice publishes exactly `expected` on the service port.
fn is_repaired(slice: &EndpointSlice, expected: &[String]) -> bool {
    let addresses: Vec<&String> = slice
        .endpoints
        .iter()
        .flatten()
        .flat_map(|e| &e.addresses)
        .collect();
    let port = slice
        .ports
        .as_ref()
        .and_then(|ports| ports.first())
        .and_then(|p| p.port);
    addresses
        .iter()
        .map(|a| a.as_str())
        .eq(expected.iter().map(String::as_str))
        && port == Some(SERVICE_PORT)
}

async fn wait_published(client: &kube::Client, expected: &[String]) -> anyhow::Result<()> {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(slice) = slices.get_opt("kubernetes").await?
            && is_repaired(&slice, expected)
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("steward did not publish default/kubernetes within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A watch of `default/kubernetes`: every version of the slice with its arrival time.
fn watch_slice(client: &kube::Client) -> mpsc::UnboundedReceiver<(Instant, EndpointSlice)> {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let (sender, receiver) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let config = watcher::Config::default().fields("metadata.name=kubernetes");
        let mut events = std::pin::pin!(watcher(slices, config));
        while let Some(event) = events.next().await {
            if let Ok(watcher::Event::Apply(slice) | watcher::Event::InitApply(slice)) = event
                && sender.send((Instant::now(), slice)).is_err()
            {
                return;
            }
        }
    });
    receiver
}

fn resource_version(slice: &EndpointSlice) -> Option<u64> {
    slice.metadata.resource_version.as_deref()?.parse().ok()
}

/// When the next edit is made.
#[derive(Clone, Copy)]
enum EditTiming {
    /// This long after the previous edit started.
    Spaced(Duration),
    /// [`EDIT_SPACING`] plus a uniformly random part of this period after the previous repair,
    /// so edits fall at a random point of a poller's cycle.
    RandomPhase(Duration),
}

impl EditTiming {
    /// The longest a repair may take.
    fn timeout(self) -> Duration {
        match self {
            Self::Spaced(_) => Duration::from_secs(15),
            Self::RandomPhase(period) => period + Duration::from_secs(15),
        }
    }
}

/// Edits the slice `edits` times and returns how long each edit stayed visible.
async fn drift_repairs(
    client: &kube::Client,
    expected: &[String],
    edits: usize,
    timing: EditTiming,
) -> anyhow::Result<Vec<Duration>> {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let mut events = watch_slice(client);
    // Let the watch start before the first edit.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut repairs = Vec::with_capacity(edits);
    for i in 0..edits {
        if let EditTiming::RandomPhase(period) = timing {
            tokio::time::sleep(EDIT_SPACING + period.mul_f64(random_fraction())).await;
        }
        let edit_started = Instant::now();
        while events.try_recv().is_ok() {}
        let tampered = serde_json::json!({
            "endpoints": [{"addresses": [format!("10.0.0.{}", 50 + i % 100)]}]
        });
        let patched = slices
            .patch(
                "kubernetes",
                &PatchParams::default(),
                &Patch::Merge(&tampered),
            )
            .await
            .context("editing default/kubernetes")?;
        let edited_version = resource_version(&patched);
        repairs.push(wait_repair(&mut events, edited_version, expected, timing.timeout()).await?);
        if let EditTiming::Spaced(spacing) = timing {
            tokio::time::sleep_until((edit_started + spacing).into()).await;
        }
    }
    Ok(repairs)
}

/// From the watch event of the edit (version `edited`) to the first later repaired version.
async fn wait_repair(
    events: &mut mpsc::UnboundedReceiver<(Instant, EndpointSlice)>,
    edited: Option<u64>,
    expected: &[String],
    timeout: Duration,
) -> anyhow::Result<Duration> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut edit_seen: Option<Instant> = None;
    loop {
        let (arrived, slice) = tokio::time::timeout_at(deadline, events.recv())
            .await
            .with_context(|| format!("no repair within {timeout:?}"))?
            .context("the watch ended")?;
        let version = resource_version(&slice);
        if version == edited {
            edit_seen = Some(arrived);
        } else if let Some(seen) = edit_seen.filter(|_| version > edited)
            && is_repaired(&slice, expected)
        {
            return Ok(arrived.duration_since(seen));
        }
    }
}

async fn create_config_maps(
    client: &kube::Client,
    namespace: &str,
    count: usize,
) -> anyhow::Result<()> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let blob = "x".repeat(100 * 1024);
    for i in 0..count {
        let config_map: ConfigMap = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": format!("blob-{i}")},
            "data": {"blob": blob},
        }))?;
        api.create(&PostParams::default(), &config_map).await?;
    }
    Ok(())
}

/// An admin client whose connections go to `relay` (same TLS identity; the serving certificate
/// names 127.0.0.1, so verification still passes).
async fn client_via(plane: &ControlPlane, relay: SocketAddr) -> anyhow::Result<kube::Client> {
    let kubeconfig = Kubeconfig::read_from(plane.kubeconfig_path())?;
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    config.cluster_url = format!("https://{relay}").parse()?;
    Ok(kube::Client::try_from(config)?)
}

/// One warm-up LIST, then `count` timed ones; returns (response bytes, elapsed).
async fn timed_lists(
    client: &kube::Client,
    path: &str,
    count: usize,
) -> anyhow::Result<(u64, Duration)> {
    let list = || async {
        let request = http::Request::get(path).body(Vec::new())?;
        anyhow::Ok(client.request_text(request).await?.len() as u64)
    };
    list().await?;
    let started = Instant::now();
    let mut bytes = 0;
    for _ in 0..count {
        bytes += list().await?;
    }
    Ok((bytes, started.elapsed()))
}
