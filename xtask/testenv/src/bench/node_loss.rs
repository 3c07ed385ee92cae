//! `cargo xtask bench node-loss`: the e2e's node loss ([`crate::e2e::node_loss`]) once per round,
//! each on a fresh cluster of two nodes, and its timings as figures: how soon the lost replica
//! stops getting traffic (steward's and pod-proxier's peer checks against Kubernetes' own node
//! controller, all measured in the same round), how soon the leaders move, how many requests the
//! steady clients lose and when the last one failed.
//!
//! A round is one cluster and one loss, so the contenders of a figure are measured in the same
//! round by construction; there is no order to randomise.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use super::report::{Bound, Goal, Metric, Recorder, Verdict, verdict_of_rounds};
use super::{Outcome, Settings};
use crate::e2e::node_loss::{self, LossFigures};
use crate::e2e::{Env, start_cluster_of};
use crate::images::Built;
use k8s_reconcile::leader::LeaseConfig;

/// How the rounds ran, for the report's head (in place of the loopback benches' pinning).
pub const SCHEDULE: &str = "not pinned: the charts run as Pods of a fresh two-node cluster each \
     round, and every contender is measured in that round's one node loss";

const UNROUTED: Metric = Metric::lower(
    "loss to the lost replica out of its Service's endpoints",
    "s",
);
const LEADER: Metric = Metric::lower("loss to a new leader holding the Lease", "s");
const FAILED: Metric = Metric::lower(
    "requests failed from the loss on (one every 50 ms)",
    "requests",
);
const RECOVERY: Metric = Metric::lower("loss to the last failed request", "s");

const STEWARD: &str = "steward (peer check)";
const NODE_CONTROLLER: &str = "Kubernetes (node controller)";
const POD_PROXIER: &str = "pod-proxier";
const POD_PROXIER_CHECK: &str = "pod-proxier (peer check)";
const OPERATOR: &str = "rstream-operator";

/// The latest a new leader may take the Lease, by the election's design with the charts' default
/// timings: the follower's last view of the renewal is up to one retry period old, the Lease runs
/// its duration, the expiry is seen at the next attempt (one retry period), and one attempt may be
/// cut short by a dead connection (the attempt limit).
fn leader_bound() -> Duration {
    let lease = LeaseConfig::new("-", "-", "-");
    lease.retry_period + lease.lease_duration + lease.retry_period + lease.attempt_limit()
}

pub fn contenders(_: &Settings) -> Vec<(&'static str, String)> {
    vec![
        (
            STEWARD,
            "2 replicas, one per node; peerCheck.interval 1 s (the chart's default): a replica \
             whose peer fails two dials in a row is unpublished from default/kubernetes"
                .to_owned(),
        ),
        (
            POD_PROXIER_CHECK,
            "2 replicas, one per node; peerCheckInterval 1 s, peerCheckFailures 2 (the chart's \
             defaults): the survivor marks the lost replica's Pod not Ready"
                .to_owned(),
        ),
        (
            NODE_CONTROLLER,
            "kube-controller-manager with --node-monitor-grace-period 20 s (the test cluster's): \
             a plain Deployment's Pod on the lost node leaves its Service once the node is \
             NotReady"
                .to_owned(),
        ),
        (
            POD_PROXIER,
            "2 replicas, one per node, the leader on the lost node; Lease 15 s / renew 10 s / \
             retry 2 s"
                .to_owned(),
        ),
        (
            OPERATOR,
            format!(
                "2 managers and a tunnel's 2 agents, one per node, the leader and the tunnel's \
                 holder on the lost node; Lease 15 s / renew 10 s / retry 2 s; the agents' \
                 heartbeats every {} s (the engine frees a silent holder's hostname after 3)",
                crate::e2e::node_loss::HEARTBEAT_SECONDS
            ),
        ),
    ]
}

/// Runs [`Settings::rounds`] node losses and turns them into figures.
pub fn run(settings: &Settings, helm: &Path, built: &[Built]) -> anyhow::Result<Outcome> {
    let runtime = tokio::runtime::Runtime::new()?;
    let mut recorder = Recorder::default();
    let mut failed_rounds = Vec::new();
    for round in 0..settings.rounds {
        let started = Instant::now();
        eprintln!("bench node-loss: round {}/{}", round + 1, settings.rounds);
        let (figures, passed) = runtime
            .block_on(one_loss(helm, built))
            .with_context(|| format!("round {}", round + 1))?;
        if !passed {
            failed_rounds.push(round + 1);
        }
        record(&mut recorder, round, &figures);
        eprintln!(
            "bench node-loss: round {} done in {:.0?}{}",
            round + 1,
            started.elapsed(),
            if passed { "" } else { " (an e2e check failed)" }
        );
    }
    let figures = recorder.finish(&[NODE_CONTROLLER]);
    let per_round = |metric: &Metric, contender: &str| -> Vec<f64> {
        figures
            .iter()
            .find(|f| f.name == metric.name)
            .and_then(|f| f.series.iter().find(|s| s.contender == contender))
            .map(|s| s.samples.clone())
            .unwrap_or_default()
    };
    let bound = Bound::AtMost(0.5);
    let mut goals = Vec::new();
    for contender in [STEWARD, POD_PROXIER_CHECK] {
        let ratios = figures
            .iter()
            .find(|f| f.name == UNROUTED.name)
            .map(|f| f.paired_ratios(contender, NODE_CONTROLLER))
            .unwrap_or_default();
        goals.push(Goal {
            goal: format!(
                "{}: {contender} {} {NODE_CONTROLLER}",
                UNROUTED.name,
                bound.relation()
            ),
            measured: spread(&ratios, "x"),
            met: verdict_of_rounds(&ratios, bound),
        });
    }
    let steward_failed = per_round(&FAILED, STEWARD);
    goals.push(Goal {
        goal: format!(
            "{STEWARD}: a lost node costs its clients at most the request in flight (the client \
             sends one at a time): <= 1 failed request"
        ),
        measured: spread(&steward_failed, " requests"),
        met: every_round(&steward_failed, |n| n <= 1.0),
    });
    let limit = leader_bound().as_secs_f64();
    for contender in [POD_PROXIER, OPERATOR] {
        let moves = per_round(&LEADER, contender);
        goals.push(Goal {
            goal: format!(
                "{contender}: {} <= {limit:.1} s (by design: one retry period, the Lease's \
                 duration, one retry period, one attempt cut short by a dead connection)",
                LEADER.name
            ),
            measured: spread(&moves, " s"),
            met: every_round(&moves, |s| s <= limit),
        });
    }
    let mut notes = vec![
        "Each round is one `cargo xtask e2e --chart node-loss` run: a fresh cluster of two \
         nodes, the three charts with a replica on each, a steady client of each (a request \
         every 50 ms, 3 s limit), then the second node's kubelet, kube-proxy and containerd \
         killed and its link taken down (no drain). Times run from that moment."
            .to_owned(),
        "Unlike the loopback benches, a round measures every contender in the same node loss, \
         at once, not back to back; and a goal on one contender's own figure is judged like a \
         paired one, on every round: met when it holds in all, missed when in none, within noise \
         otherwise."
            .to_owned(),
        "The lost replica's time out of its Service compares steward's and pod-proxier's peer \
         checks with what Kubernetes does for any Service: the same loss, the same round, a \
         plain Deployment's Pod on the lost node behind its own Service (the node controller \
         marks the node NotReady after its grace period, then the EndpointSlice controller \
         drops the Pod)."
            .to_owned(),
    ];
    if !failed_rounds.is_empty() {
        notes.push(format!(
            "An e2e check failed in round(s) {failed_rounds:?} (see target/e2e/report.md of the \
             last round); their figures are included as measured."
        ));
    }
    if settings.rounds < 5 {
        notes.push(format!(
            "{} round(s): a smoke run, not enough for met or missed to mean much.",
            settings.rounds
        ));
    }
    Ok(Outcome {
        figures,
        goals,
        notes,
    })
}

/// One cluster of two nodes and one node loss: the figures, and whether every e2e check passed.
async fn one_loss(helm: &Path, built: &[Built]) -> anyhow::Result<(LossFigures, bool)> {
    let plane = start_cluster_of(2).await?;
    let env = Env::new(&plane, helm.to_path_buf(), built)?;
    let (mut report, figures) = node_loss::measure(&env).await;
    report.expect(&node_loss::expected_scenarios());
    plane.stop();
    let Some(figures) = figures else {
        bail!(
            "the node loss was not measured: {}",
            report.error.as_deref().unwrap_or("no error recorded")
        );
    };
    Ok((figures, report.passed()))
}

fn record(recorder: &mut Recorder, round: usize, figures: &LossFigures) {
    let mut time = |metric: Metric, contender: &str, value: Option<Duration>| match value {
        Some(value) => recorder.record_round(metric, contender, round, value.as_secs_f64()),
        None => recorder.note(
            metric,
            contender,
            format!("not reached in round {}", round + 1),
        ),
    };
    time(UNROUTED, STEWARD, figures.steward_unpublished);
    time(UNROUTED, POD_PROXIER_CHECK, figures.pod_proxier_unrouted);
    time(UNROUTED, NODE_CONTROLLER, figures.node_controller_unrouted);
    time(LEADER, POD_PROXIER, figures.pod_proxier_leader);
    time(LEADER, OPERATOR, figures.operator_leader);
    for (contender, tally) in [
        (STEWARD, figures.steward_client),
        (POD_PROXIER, figures.pod_proxier_client),
        (OPERATOR, figures.operator_client),
    ] {
        #[expect(clippy::cast_precision_loss, reason = "request counts are small")]
        recorder.record_round(FAILED, contender, round, tally.failed as f64);
        recorder.record_round(RECOVERY, contender, round, tally.recovery.as_secs_f64());
    }
}

/// Met when `holds` for every round, missed when for none, within noise otherwise.
fn every_round(values: &[f64], holds: impl Fn(f64) -> bool) -> Verdict {
    let holding = values.iter().filter(|v| holds(**v)).count();
    match (values.len(), holding) {
        (0, _) => Verdict::NotJudged,
        (n, h) if h == n => Verdict::Met,
        (_, 0) => Verdict::Missed,
        _ => Verdict::WithinNoise,
    }
}

/// "median (min–max, n rounds)".
fn spread(values: &[f64], unit: &str) -> String {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match (sorted.first(), sorted.last()) {
        (Some(min), Some(max)) => format!(
            "{:.2}{unit} ({min:.2}–{max:.2}, {} rounds)",
            super::report::median_of_sorted(&sorted),
            sorted.len()
        ),
        _ => "not measured".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_goal_on_every_round_is_met_missed_or_within_noise() {
        let at_most_one = |n: f64| n <= 1.0;
        assert_eq!(every_round(&[0.0, 1.0, 1.0], at_most_one), Verdict::Met);
        assert_eq!(every_round(&[2.0, 3.0], at_most_one), Verdict::Missed);
        assert_eq!(every_round(&[0.0, 2.0], at_most_one), Verdict::WithinNoise);
        assert_eq!(every_round(&[], at_most_one), Verdict::NotJudged);
    }

    #[test]
    fn the_spread_gives_median_min_and_max() {
        assert_eq!(
            spread(&[16.3, 15.2, 29.0], " s"),
            "16.30 s (15.20–29.00, 3 rounds)"
        );
        assert_eq!(spread(&[], " s"), "not measured");
    }
}
