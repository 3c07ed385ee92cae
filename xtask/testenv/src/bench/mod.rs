//! `cargo xtask bench <proxy|steward|rstream|operator|pod-proxier|all>`: benchmarks on loopback.
//! `cargo xtask bench node-loss`: the e2e's node loss on a cluster of two nodes, round after round,
//! its timings as figures (its `node_loss` module; not part of `all`, it needs the release images).
//!
//! Every bench measures its baseline in the same run, alternates its contenders (A B C A B C ...)
//! over several rounds, reports medians with min/max, prints a Markdown table and writes
//! `<out>/<bench>.json` and `<out>/<bench>.md`, and `<out>/summary.md` over the benches run.
//! Relays run on CPU 1; `bench proxy`'s load generator and sink are processes of their own
//! (`procs`) on CPU 0, the other benches' generators run in-process (`load`) on CPU 0.

mod cgroup;
mod heaptrack;
mod load;
mod node_loss;
mod operator;
mod pod_proxier;
mod procs;
mod proxy;
mod report;
mod rstream;
mod steward;
mod system;
#[allow(unsafe_code)]
mod uring_probe;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context as _, bail};

use report::{Figure, Goal, Machine, Report};

#[derive(clap::Args)]
/// `cargo xtask bench`'s arguments.
pub struct Args {
    /// Which bench to run.
    #[arg(value_enum)]
    bench: Which,
    /// Rounds of alternated contenders [default: 5, or 2 with --quick].
    #[arg(long)]
    rounds: Option<usize>,
    /// A short smoke run: small transfers, short phases, few rounds.
    #[arg(long)]
    quick: bool,
    /// Also profile into xtask/bench-profile/, the files the report's bound notes cite: bench
    /// proxy each relay (perf record, strace -c), bench operator the manager's heap (heaptrack).
    #[arg(long)]
    profile: bool,
    /// Where JSON and summary.md go (relative paths are under the workspace root).
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Which {
    Proxy,
    Steward,
    Rstream,
    Operator,
    PodProxier,
    NodeLoss,
    All,
}

/// What every bench is told.
pub struct Settings {
    rounds: usize,
    quick: bool,
    /// Profile the relays and the operator's heap (`--profile`).
    profile: bool,
    /// The open-file limit in force (children inherit it).
    fd_limit: u64,
}

/// What a bench hands back; [`run`] adds the machine's state and writes it out.
pub struct Outcome {
    figures: Vec<Figure>,
    goals: Vec<Goal>,
    notes: Vec<String>,
}

type Bench = fn(&Settings) -> anyhow::Result<Outcome>;
/// Each contender's configuration by name, as the summary shows it next to its figures.
type Contenders = fn(&Settings) -> Vec<(&'static str, String)>;

const BENCHES: [(&str, Which, Bench, Contenders); 5] = [
    ("proxy", Which::Proxy, proxy::run, proxy::contenders),
    ("steward", Which::Steward, steward::run, steward::contenders),
    ("rstream", Which::Rstream, rstream::run, rstream::contenders),
    (
        "operator",
        Which::Operator,
        operator::run,
        operator::contenders,
    ),
    (
        "pod-proxier",
        Which::PodProxier,
        pod_proxier::run,
        pod_proxier::contenders,
    ),
];

impl Args {
    /// Whether the bench runs on a cluster (the caller builds the images and hands them to
    /// [`run_on_cluster`]) rather than on loopback ([`run`]).
    pub fn needs_cluster(&self) -> bool {
        self.bench == Which::NodeLoss
    }
}

/// Runs `bench node-loss` with Helm at `helm` and the release images `built`, and writes its
/// report as [`run`] does.
pub fn run_on_cluster(
    args: &Args,
    helm: std::path::PathBuf,
    built: &[crate::images::Built],
) -> anyhow::Result<()> {
    let settings = settings(args);
    let mut report = run_one(
        "node-loss",
        |settings| node_loss::run(settings, &helm, built),
        node_loss::contenders,
        &settings,
    )?;
    report.machine.pinning = node_loss::SCHEDULE.to_owned();
    println!("{}", report::markdown(&report));
    write_out(&crate::workspace::root().join(&args.out), &[report], &[])
}

fn settings(args: &Args) -> Settings {
    Settings {
        rounds: args.rounds.unwrap_or(if args.quick { 2 } else { 5 }).max(1),
        quick: args.quick,
        profile: args.profile,
        fd_limit: system::raise_fd_limit(),
    }
}

/// Set in the release build of xtask that a debug build hands the bench to.
const RELEASE_ENV: &str = "NETKIT_BENCH_RELEASE";

/// Runs the chosen benches and writes their JSON and `summary.md` (see the module docs).
pub fn run(args: &Args) -> anyhow::Result<()> {
    // A generator or sink process started by a bench (see `procs`).
    if procs::run_role()? {
        return Ok(());
    }
    // `cargo xtask` is a debug build: a debug load generator would measure itself, not the relays.
    if cfg!(debug_assertions) && std::env::var_os(RELEASE_ENV).is_none() {
        return rerun_in_release();
    }
    if args.needs_cluster() {
        bail!("bench node-loss runs on a cluster: `cargo xtask bench node-loss` builds its images");
    }
    let settings = settings(args);
    let out = crate::workspace::root().join(&args.out);
    eprintln!(
        "bench: open-file limit {}, {}",
        settings.fd_limit,
        system::loadavg()
    );

    let mut reports = Vec::new();
    let mut failures = Vec::new();
    for (name, which, bench, contenders) in BENCHES {
        if args.bench != which && args.bench != Which::All {
            continue;
        }
        match run_one(name, bench, contenders, &settings) {
            Ok(report) => {
                println!("{}", report::markdown(&report));
                reports.push(report);
            }
            // `all` goes on with the other benches and reports the failure in the summary.
            Err(error) if args.bench == Which::All => {
                eprintln!("bench {name} failed: {error:#}");
                failures.push((name.to_owned(), format!("{error:#}")));
            }
            Err(error) => return Err(error.context(format!("bench {name}"))),
        }
    }
    write_out(&out, &reports, &failures)?;
    if !failures.is_empty() {
        bail!("{} bench(es) failed", failures.len());
    }
    Ok(())
}

/// Each bench's JSON and Markdown, and `summary.md` (for `all`, over every bench), into `out`.
fn write_out(
    out: &std::path::Path,
    reports: &[Report],
    failures: &[(String, String)],
) -> anyhow::Result<()> {
    for report in reports {
        report::write_json(&out.join(format!("{}.json", report.bench)), report)?;
        std::fs::write(
            out.join(format!("{}.md", report.bench)),
            report::markdown(report),
        )?;
    }
    let summary = report::summary_markdown(reports, failures);
    let path = out.join("summary.md");
    std::fs::create_dir_all(out)?;
    std::fs::write(&path, &summary)?;
    println!("{summary}");
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn rerun_in_release() -> anyhow::Result<()> {
    let xtask = system::cargo_build_release(&["-p", "xtask", "--bin", "xtask"])?;
    let status = std::process::Command::new(xtask)
        .args(std::env::args_os().skip(1))
        .env(RELEASE_ENV, "1")
        .status()
        .context("running the release build of xtask")?;
    if !status.success() {
        bail!("bench failed ({status})");
    }
    Ok(())
}

fn run_one(
    name: &str,
    bench: impl FnOnce(&Settings) -> anyhow::Result<Outcome>,
    contenders: Contenders,
    settings: &Settings,
) -> anyhow::Result<Report> {
    let load_at_start = system::loadavg();
    let started = Instant::now();
    let outcome = bench(settings)?;
    eprintln!("bench {name}: {:.1?}", started.elapsed());
    Ok(Report {
        bench: name.to_owned(),
        quick: settings.quick,
        rounds: settings.rounds,
        machine: Machine {
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            load_at_start,
            load_at_end: system::loadavg(),
            pinning: format!("{}; contenders alternated", system::pinning_note()),
        },
        contenders: contenders(settings)
            .into_iter()
            .filter(|(contender, _)| {
                outcome
                    .figures
                    .iter()
                    .any(|f| f.series.iter().any(|s| s.contender == *contender))
            })
            .map(|(contender, configuration)| (contender.to_owned(), configuration))
            .collect(),
        figures: outcome.figures,
        goals: outcome.goals,
        notes: outcome.notes,
    })
}
