//! `bench operator`: the rstream-operator manager as a process against a real etcd +
//! kube-apiserver. Each round, many RstreamTunnels exist in a fresh namespace before a manager
//! scoped to it (`--namespace`) starts; measured are the time until every tunnel has its five
//! children, the manager's peak RSS, and its write and read calls (from the API server's audit
//! log) during a steady-state window of at least three resyncs (the manager runs with a short
//! `--resync-period`), where the goals are no write at all and at most one read per tunnel and
//! resync.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::{AuditEvent, ControlPlane, Identity};
use anyhow::Context as _;

use super::report::{Goal, Metric, Recorder, notes_from};
use super::{Outcome, Settings};
use super::{heaptrack, system};

mod objects;

use objects::{
    create_prerequisites, create_tunnels, peak_rss_kib, start_manager, wait_children, wait_quiet,
};

const MANAGER: &str = "rstream-operator";
/// The manager's client-certificate user: its writes are counted by this name.
const MANAGER_USER: &str = "bench-manager";

const CONVERGE: Metric = Metric::lower("manager start to every tunnel's 5 children", "s");
const PEAK_RSS: Metric = Metric::lower("manager peak RSS (VmHWM)", "MiB");
const CONVERGE_WRITES: Metric =
    Metric::lower("manager write calls to converge, per tunnel", "calls");
const STEADY_WRITES: Metric =
    Metric::lower("manager write calls in the steady-state window", "calls");
const STEADY_READS: Metric = Metric::lower(
    "manager reads (get, list) per tunnel and resync in the steady-state window",
    "calls",
);

/// ConfigMap, ServiceAccount, Role, RoleBinding and Deployment.
const CHILD_KINDS: usize = 5;
/// Tunnels created at once: enough to keep the API server busy, few enough not to hit its limits.
const CREATE_CONCURRENCY: usize = 16;
/// The manager has converged once its write count has not moved for this long.
const QUIET: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(250);

struct Sizes {
    tunnels: usize,
    /// The manager's `--resync-period`.
    resync: Duration,
    /// One steady-state window (one per round); at least three resyncs long.
    steady: Duration,
    converge_timeout: Duration,
}

impl Sizes {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                tunnels: 50,
                resync: Duration::from_secs(3),
                steady: Duration::from_secs(10),
                converge_timeout: Duration::from_secs(120),
            }
        } else {
            Self {
                tunnels: 2000,
                resync: Duration::from_secs(15),
                steady: Duration::from_secs(50),
                converge_timeout: Duration::from_secs(900),
            }
        }
    }
}

/// The report's prose, filled with this run's settings.
const NOTES_TEMPLATE: &str = include_str!("../operator_notes.md");

/// The manager's peak RSS goal, in MiB.
const RSS_GOAL_MIB: f64 = 64.0;
/// The steady-state read goal: API reads per tunnel and resync.
const READS_GOAL: f64 = 1.0;

/// What one round (one manager, its own namespace of tunnels) measured.
struct Run {
    converge: Duration,
    peak_rss_after_converge_kib: u64,
    peak_rss_kib: u64,
    settle: Duration,
    converge_writes: usize,
    /// The manager's writes in the window, every user's write count in the window, and the
    /// manager's requests of any kind in the window.
    window: Window,
}

/// One steady-state window.
struct Window {
    manager_writes: Vec<AuditEvent>,
    manager_reads: Vec<AuditEvent>,
    writes_per_user: BTreeMap<String, usize>,
    manager_requests: usize,
}

pub fn run(settings: &Settings) -> anyhow::Result<Outcome> {
    let binary = system::cargo_build_release(&["-p", "rstream-operator", "--bin", MANAGER])?;
    let sizes = Sizes::new(settings.quick);
    debug_assert!(sizes.steady >= sizes.resync * 3);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let measured = runtime.block_on(async {
        eprintln!("operator: starting etcd and kube-apiserver");
        let plane = ControlPlane::builder().start().await?;
        plane.install_crds(&rstream_operator::crds()).await?;
        let mut runs = Vec::with_capacity(settings.rounds);
        for round in 1..=settings.rounds {
            eprintln!("operator: round {round} of {}", settings.rounds);
            match measure(&plane, &binary, &sizes, None).await {
                Ok(run) => runs.push(run),
                Err(e) => {
                    plane.stop();
                    return Err(e);
                }
            }
        }
        if settings.profile {
            eprintln!("operator: one more round under heaptrack (its figures are not kept)");
            if let Err(e) = heap_profile_round(&plane, &binary, &sizes).await {
                plane.stop();
                return Err(e);
            }
        }
        plane.stop();
        anyhow::Ok(runs)
    })?;
    Ok(outcome(&sizes, settings.rounds, &measured))
}

/// One round: a fresh namespace of tunnels and a manager scoped to it (earlier rounds' objects
/// stay, unseen by it), converged, then one steady-state window.
///
/// With `heap`, the manager runs with heaptrack's preload library writing its raw record there,
/// and is stopped with SIGTERM at the end so the record is complete.
async fn measure(
    plane: &ControlPlane,
    binary: &Path,
    sizes: &Sizes,
    heap: Option<&Path>,
) -> anyhow::Result<Run> {
    let client = plane.client().await?;
    let namespace = plane.create_namespace("bench-operator").await?;
    create_prerequisites(&client, &namespace).await?;
    eprintln!("operator: creating {} RstreamTunnels", sizes.tunnels);
    create_tunnels(&client, &namespace, sizes.tunnels).await?;

    let dir = tempfile::Builder::new()
        .prefix("netkit-bench-operator-")
        .tempdir()?;
    let kubeconfig = plane
        .kubeconfig_as(&Identity::User {
            name: MANAGER_USER.into(),
            group: Some("system:masters".into()),
        })
        .await?;
    let writes_before = plane.writes_by(MANAGER_USER).await?.len();
    let started = Instant::now();
    let mut manager = start_manager(binary, &kubeconfig, &namespace, sizes, dir.path(), heap)?;
    eprintln!("operator: waiting for every tunnel's children");
    wait_children(&client, &namespace, sizes, &mut manager).await?;
    let converge = started.elapsed();
    let peak_rss_after_converge_kib = peak_rss_kib(manager.pid())?;

    let settled = Instant::now();
    let converge_writes =
        wait_quiet(plane, sizes.converge_timeout, &mut manager).await? - writes_before;
    let settle = settled.elapsed();
    eprintln!(
        "operator: converged after {converge:.1?}, quiet after {settle:.1?} more; {:?} of steady state (resync every {:?})",
        sizes.steady, sizes.resync
    );
    let window = steady_window(plane, sizes.steady, &mut manager).await?;
    let run = Run {
        converge,
        peak_rss_after_converge_kib,
        peak_rss_kib: peak_rss_kib(manager.pid())?,
        settle,
        converge_writes,
        window,
    };
    if heap.is_some() {
        manager.terminate(Duration::from_secs(30))?;
    }
    Ok(run)
}

/// What bounds the manager's memory, citing the committed heap profile; nothing without one.
fn heap_note() -> Vec<String> {
    let profile = format!("{}/{HEAP_PROFILE}", super::proxy::PROFILE_DIR);
    if !crate::workspace::root().join(&profile).is_file() {
        return Vec::new();
    }
    vec![format!(
        "What bounds the peak RSS: {profile}, heaptrack's record of one extra round made by `cargo xtask bench operator --profile`, committed with this report: the heap at its peak by function (watch caches, the reconciles in flight), then heaptrack's own list of the biggest consumers."
    )]
}

/// The heap profile `--profile` writes under [`PROFILE_DIR`](super::proxy::PROFILE_DIR).
pub const HEAP_PROFILE: &str = "operator-manager-heap.txt";

/// One unmeasured round with the manager under heaptrack; writes the peak's biggest consumers
/// (heaptrack_print) to [`HEAP_PROFILE`], the evidence for what bounds the manager's RSS.
async fn heap_profile_round(
    plane: &ControlPlane,
    binary: &Path,
    sizes: &Sizes,
) -> anyhow::Result<()> {
    crate::debian::install_packages(&["heaptrack"], "bench operator --profile")?;
    let dir = tempfile::Builder::new()
        .prefix("netkit-bench-heap-")
        .tempdir()?;
    let raw = dir.path().join("manager.heaptrack.raw");
    let run = measure(plane, binary, sizes, Some(&raw)).await?;
    let (peaks, by_function) = heaptrack::analyse(&raw, dir.path())?;
    let out = crate::workspace::root()
        .join(super::proxy::PROFILE_DIR)
        .join(HEAP_PROFILE);
    let text = format!(
        "# heaptrack of rstream-operator's manager converging {} tunnels, then {:?} of steady state\n\
         # (one unmeasured round of `cargo xtask bench operator --profile`; VmHWM under heaptrack {:.1} MiB)\n\n\
         ## Heap at its peak, by function (inclusive: a function's own allocations and its callees')\n\n{}\n\
         ## heaptrack_print: the biggest peak consumers, one backtrace each\n\n{peaks}",
        sizes.tunnels,
        sizes.steady,
        run.peak_rss_kib as f64 / 1024.0,
        by_function,
    );
    std::fs::write(&out, text).with_context(|| format!("writing {}", out.display()))?;
    eprintln!("operator: heap profile in {}", out.display());
    Ok(())
}

/// Counts the writes made while `length` passes (the audit barrier of `writes_by` makes sure
/// every request answered before each end of the window is in the log).
async fn steady_window(
    plane: &ControlPlane,
    length: Duration,
    manager: &mut system::Service,
) -> anyhow::Result<Window> {
    plane.writes_by(MANAGER_USER).await?;
    let start = plane.audit_events()?.len();
    tokio::time::sleep(length).await;
    manager.check_running()?;
    plane.writes_by(MANAGER_USER).await?;
    let events = plane.audit_events()?.split_off(start);
    let mut writes_per_user: BTreeMap<String, usize> = BTreeMap::new();
    for event in events.iter().filter(|e| e.is_write()) {
        *writes_per_user
            .entry(event.user.username.clone())
            .or_default() += 1;
    }
    let manager_requests = events
        .iter()
        .filter(|e| e.user.username == MANAGER_USER)
        .count();
    let manager_reads = events
        .iter()
        .filter(|e| e.user.username == MANAGER_USER && matches!(e.verb.as_str(), "get" | "list"))
        .cloned()
        .collect();
    let manager_writes = events
        .into_iter()
        .filter(|e| e.user.username == MANAGER_USER && e.is_write())
        .collect();
    Ok(Window {
        manager_writes,
        manager_reads,
        writes_per_user,
        manager_requests,
    })
}

fn outcome(sizes: &Sizes, rounds: usize, runs: &[Run]) -> Outcome {
    let mut recorder = Recorder::default();
    let mib = |kib: u64| kib as f64 / 1024.0;
    let resyncs = sizes.steady.as_secs_f64() / sizes.resync.as_secs_f64();
    let reads_per =
        |run: &Run| run.window.manager_reads.len() as f64 / sizes.tunnels as f64 / resyncs;
    for run in runs {
        recorder.record(CONVERGE, MANAGER, run.converge.as_secs_f64());
        recorder.record(PEAK_RSS, MANAGER, mib(run.peak_rss_kib));
        recorder.record(
            CONVERGE_WRITES,
            MANAGER,
            run.converge_writes as f64 / sizes.tunnels as f64,
        );
        recorder.record(
            STEADY_WRITES,
            MANAGER,
            run.window.manager_writes.len() as f64,
        );
        recorder.record(STEADY_READS, MANAGER, reads_per(run));
    }
    let all_reads: Vec<AuditEvent> = runs
        .iter()
        .flat_map(|r| r.window.manager_reads.iter().cloned())
        .collect();
    let all_writes: Vec<AuditEvent> = runs
        .iter()
        .flat_map(|r| r.window.manager_writes.iter().cloned())
        .collect();
    let per_round: Vec<String> = runs
        .iter()
        .enumerate()
        .map(|(i, run)| {
            let w = &run.window;
            let users: Vec<String> = w
                .writes_per_user
                .iter()
                .map(|(user, n)| format!("{user} {n}"))
                .collect();
            format!(
                "round {}: converged in {:.1?}, quiet {:.1?} later, {} writes to converge, peak RSS {:.1} MiB when converged and {:.1} MiB at the end; window writes {} (manager requests of any verb: {})",
                i + 1,
                run.converge,
                run.settle,
                run.converge_writes,
                mib(run.peak_rss_after_converge_kib),
                mib(run.peak_rss_kib),
                if users.is_empty() {
                    "none".to_owned()
                } else {
                    users.join(", ")
                },
                w.manager_requests
            )
        })
        .collect();
    let max_rss = runs
        .iter()
        .map(|r| mib(r.peak_rss_kib))
        .fold(0.0_f64, f64::max);
    let max_reads = runs.iter().map(reads_per).fold(0.0_f64, f64::max);
    let measured = !runs.is_empty();
    Outcome {
        figures: recorder.finish(&[]),
        goals: vec![
            Goal {
                goal: format!(
                    "0 write calls in the steady-state windows ({rounds} x {:?}, >= 3 resyncs of {:?} each)",
                    sizes.steady, sizes.resync
                ),
                measured: format!("{} write calls", all_writes.len()),
                met: Some(measured && all_writes.is_empty()).into(),
            },
            Goal {
                goal: format!(
                    "<= {READS_GOAL} API read per tunnel and resync in the steady state (audit log, the manager's get and list)"
                ),
                measured: format!("{max_reads:.3} at most over {rounds} round(s)"),
                met: Some(measured && max_reads <= READS_GOAL).into(),
            },
            Goal {
                goal: format!(
                    "{} tunnels converge with manager peak RSS < {RSS_GOAL_MIB} MiB",
                    sizes.tunnels
                ),
                measured: format!("{max_rss:.1} MiB at most over {rounds} round(s)"),
                met: Some(measured && max_rss < RSS_GOAL_MIB).into(),
            },
        ],
        notes: [
            notes_from(
                NOTES_TEMPLATE,
                &[
                    ("tunnels", sizes.tunnels.to_string()),
                    ("poll", format!("{POLL:?}")),
                    ("manager_user", MANAGER_USER.to_owned()),
                    ("quiet", format!("{QUIET:?}")),
                    ("steady", format!("{:?}", sizes.steady)),
                    ("resync_secs", sizes.resync.as_secs().to_string()),
                    ("writes", describe(&all_writes)),
                    ("reads", describe(&all_reads)),
                    ("per_round", per_round.join("; ")),
                ],
            ),
            heap_note(),
        ]
        .concat(),
    }
}

/// Each contender's configuration, as the summary shows it.
pub fn contenders(settings: &Settings) -> Vec<(&'static str, String)> {
    let sizes = Sizes::new(settings.quick);
    vec![(
        MANAGER,
        format!(
            "release build, --resync-period={}s, --log-level=warn, client-certificate user {MANAGER_USER} (system:masters), unpinned; {} RstreamTunnels",
            sizes.resync.as_secs(),
            sizes.tunnels
        ),
    )]
}

/// `verb resource[/subresource]: count` for each kind of request, or "none".
fn describe(writes: &[AuditEvent]) -> String {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for write in writes {
        let object = write.object_ref.as_ref();
        let resource = object.map_or("?", |o| o.resource.as_str());
        let sub = object
            .and_then(|o| o.subresource.as_deref())
            .map(|s| format!("/{s}"))
            .unwrap_or_default();
        *counts
            .entry(format!("{} {resource}{sub}", write.verb))
            .or_default() += 1;
    }
    if counts.is_empty() {
        return "none".to_owned();
    }
    let parts: Vec<String> = counts.iter().map(|(k, n)| format!("{k}: {n}")).collect();
    parts.join(", ")
}
