//! Prometheus metrics of controllers and leader election (`prometheus-client`), under the names
//! and labels controller-runtime uses, so the dashboards and alerts written for Go operators
//! read ours as they are:
//!
//! | name | type | labels |
//! |---|---|---|
//! | `controller_runtime_reconcile_total` | counter | `controller`, `result` (`success`, `error`) |
//! | `controller_runtime_reconcile_errors_total` | counter | `controller` |
//! | `controller_runtime_reconcile_time_seconds` | histogram | `controller` |
//! | `leader_election_master_status` | gauge (1 leading, 0 not) | `name` |
//!
//! controller-runtime's `workqueue_*` family has no counterpart: kube-runtime's scheduler keeps
//! no queue that could be measured the same way, and a look-alike would mislead.
//!
//! [`register_build_info`] adds the `<binary>_build_info` gauge.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Labels of a reconcile outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReconcileLabels {
    /// The controller's name.
    pub controller: String,
    /// `success` or `error`.
    pub result: &'static str,
}

/// Labels naming a controller.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    /// The controller's name.
    pub controller: String,
}

/// Labels of the leader gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LeaderLabels {
    /// What is led: the controller's name.
    pub name: String,
}

/// controller-runtime's buckets of `controller_runtime_reconcile_time_seconds`.
const RECONCILE_TIME_BUCKETS: [f64; 40] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9,
    1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 15.0, 20.0,
    25.0, 30.0, 40.0, 50.0, 60.0,
];

/// Counters and histograms shared by every controller of a process.
#[derive(Debug, Clone)]
pub struct ControllerMetrics {
    reconciles: Family<ReconcileLabels, Counter>,
    errors: Family<ControllerLabels, Counter>,
    duration: Family<ControllerLabels, Histogram>,
    leader: Family<LeaderLabels, Gauge>,
}

impl ControllerMetrics {
    /// Creates the metrics and registers them in `registry` (see the [module docs](self)).
    pub fn register(registry: &mut Registry) -> Self {
        let reconciles = Family::<ReconcileLabels, Counter>::default();
        let errors = Family::<ControllerLabels, Counter>::default();
        let duration = Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(RECONCILE_TIME_BUCKETS)
        });
        let leader = Family::<LeaderLabels, Gauge>::default();
        registry.register(
            "controller_runtime_reconcile",
            "Total number of reconciliations per controller",
            reconciles.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_errors",
            "Total number of reconciliation errors per controller",
            errors.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_time_seconds",
            "Length of time per reconciliation per controller",
            duration.clone(),
        );
        registry.register(
            "leader_election_master_status",
            "Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master",
            leader.clone(),
        );
        Self {
            reconciles,
            errors,
            duration,
            leader,
        }
    }

    /// Records one reconciliation.
    pub fn observe(&self, controller: &str, ok: bool, elapsed: Duration) {
        self.reconciles
            .get_or_create(&ReconcileLabels {
                controller: controller.to_owned(),
                result: result_label(ok),
            })
            .inc();
        let labels = ControllerLabels {
            controller: controller.to_owned(),
        };
        if !ok {
            self.errors.get_or_create(&labels).inc();
        }
        self.duration
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
    }

    /// Sets the leader gauge of `name` (the controller's name).
    pub fn set_leader(&self, name: &str, leader: bool) {
        self.leader
            .get_or_create(&LeaderLabels {
                name: name.to_owned(),
            })
            .set(i64::from(leader));
    }

    /// How many reconciliations of `controller` ended with success (or not).
    pub fn reconcile_count(&self, controller: &str, ok: bool) -> u64 {
        self.reconciles
            .get_or_create(&ReconcileLabels {
                controller: controller.to_owned(),
                result: result_label(ok),
            })
            .get()
    }
}

fn result_label(ok: bool) -> &'static str {
    if ok { "success" } else { "error" }
}

/// Registers `<binary>_build_info`, a gauge of 1 labelled with the version (and the Rust
/// toolchain's target), as Go binaries export their build info; `binary` is the metric-name
/// form of the program's name (`steward_tcp_proxy`).
pub fn register_build_info(registry: &mut Registry, binary: &str, version: &str) {
    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct BuildLabels {
        version: String,
        goos: &'static str,
        goarch: &'static str,
    }
    let info = Family::<BuildLabels, Gauge>::default();
    info.get_or_create(&BuildLabels {
        version: version.to_owned(),
        goos: std::env::consts::OS,
        goarch: std::env::consts::ARCH,
    })
    .set(1);
    registry.register(
        format!("{binary}_build_info"),
        format!(
            "A metric with a constant '1' value labelled by the version {binary} was built from"
        ),
        info,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_exposed_under_controller_runtimes_names() {
        let mut registry = Registry::default();
        let metrics = ControllerMetrics::register(&mut registry);
        register_build_info(&mut registry, "demo", "1.2.3");
        metrics.observe("tunnels", true, Duration::from_millis(3));
        metrics.observe("tunnels", false, Duration::from_millis(3));
        metrics.set_leader("tunnels", true);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap_or_default();
        for line in [
            r#"controller_runtime_reconcile_total{controller="tunnels",result="success"} 1"#,
            r#"controller_runtime_reconcile_total{controller="tunnels",result="error"} 1"#,
            r#"controller_runtime_reconcile_errors_total{controller="tunnels"} 1"#,
            r#"controller_runtime_reconcile_time_seconds_count{controller="tunnels"} 2"#,
            r#"leader_election_master_status{name="tunnels"} 1"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
        assert!(
            text.lines()
                .any(|l| l.starts_with(r#"demo_build_info{version="1.2.3","#) && l.ends_with(" 1")),
            "{text}"
        );
        assert_eq!(metrics.reconcile_count("tunnels", true), 1);
    }
}
