//! `bench pod-proxier`: V1 mappings through pod-proxier against a real etcd + kube-apiserver, with
//! its embedded data plane and with a real HAProxy driven through its Runtime API. Measured: the
//! time from `POST /api/v1/mapping` to the first byte from the pod through the new mapping, and
//! bulk throughput through a mapping versus straight to the "pod" (a loopback sink). POST to
//! first byte is measured with `--auth none` and with `--auth kubernetes` (a ServiceAccount token
//! checked with TokenReview, access with SubjectAccessReview, as the chart runs it).
//!
//! Both pod-proxier processes and HAProxy run on the relay CPU; the throughput generator and sink
//! run on a thread pinned to the generator CPU.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::ControlPlane;
use anyhow::{Context as _, bail};
use kube::CustomResourceExt as _;
use pod_proxier::crd::PortMapping;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use super::report::{Metric, Recorder, notes_from};
use super::system::{self, RELAY_CPU};
use super::{Outcome, Settings};

mod mapping;
mod pods;
mod proxier;

use mapping::{map_and_time, throughput};
use pods::BannerPods;
use proxier::{Proxier, caller_token, start_with_haproxy};

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
const NOTES_TEMPLATE: &str = include_str!("../pod_proxier_notes.md");

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
