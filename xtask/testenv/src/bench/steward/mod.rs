//! `bench steward`: how fast steward-tcp-proxy repairs edits of the `default/kubernetes`
//! EndpointSlice, next to a re-creation of the seed's reconciler (get, compare, update on a 30 s
//! ticker) run against the same API server and timed the same way; and API server LIST throughput
//! through steward's relay versus straight to the API server. Runs against a real etcd +
//! kube-apiserver started with `--endpoint-reconciler-type=none`.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::ControlPlane;

use super::report::{Metric, Recorder, notes_from};
use super::system::{self, RELAY_CPU};
use super::{Outcome, Settings};

mod relay;
mod repairs;
mod seed;

use relay::{
    Steward, client_via, create_config_maps, create_proxy_service, first_publish, timed_lists,
};
use repairs::{EditTiming, drift_repairs, wait_published};
use seed::SeedPoller;

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
const NOTES_TEMPLATE: &str = include_str!("../steward_notes.md");

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
