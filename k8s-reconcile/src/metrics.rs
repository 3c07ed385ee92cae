//! Prometheus metrics of controllers and leader election (`prometheus-client`).

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of a reconcile outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReconcileLabels {
    /// The controller's name.
    pub controller: String,
    /// `ok` or `error`.
    pub result: String,
}

/// Labels naming a controller.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    /// The controller's name.
    pub controller: String,
}

/// Counters and histograms shared by every controller of a process.
#[derive(Debug, Clone)]
pub struct ControllerMetrics {
    reconciles: Family<ReconcileLabels, Counter>,
    duration: Family<ControllerLabels, Histogram>,
    leader: Family<ControllerLabels, Gauge>,
}

impl ControllerMetrics {
    /// Creates the metrics and registers them in `registry` under `reconcile_*` and `leader`.
    pub fn register(registry: &mut Registry) -> Self {
        let reconciles = Family::<ReconcileLabels, Counter>::default();
        let duration = Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 16))
        });
        let leader = Family::<ControllerLabels, Gauge>::default();
        registry.register(
            "reconcile",
            "Reconciliations by controller and result (ok, error)",
            reconciles.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Duration of reconciliations",
            duration.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica leads the controller's Lease, else 0",
            leader.clone(),
        );
        Self {
            reconciles,
            duration,
            leader,
        }
    }

    /// Records one reconciliation.
    pub fn observe(&self, controller: &str, ok: bool, elapsed: Duration) {
        self.reconciles
            .get_or_create(&ReconcileLabels {
                controller: controller.to_owned(),
                result: if ok { "ok" } else { "error" }.to_owned(),
            })
            .inc();
        self.duration
            .get_or_create(&ControllerLabels {
                controller: controller.to_owned(),
            })
            .observe(elapsed.as_secs_f64());
    }

    /// Sets the leader gauge.
    pub fn set_leader(&self, controller: &str, leader: bool) {
        self.leader
            .get_or_create(&ControllerLabels {
                controller: controller.to_owned(),
            })
            .set(i64::from(leader));
    }

    /// How many reconciliations of `controller` ended with `ok` (or not).
    pub fn reconcile_count(&self, controller: &str, ok: bool) -> u64 {
        self.reconciles
            .get_or_create(&ReconcileLabels {
                controller: controller.to_owned(),
                result: if ok { "ok" } else { "error" }.to_owned(),
            })
            .get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_exposed_in_the_text_format() {
        let mut registry = Registry::default();
        let metrics = ControllerMetrics::register(&mut registry);
        metrics.observe("tunnels", true, Duration::from_millis(3));
        metrics.observe("tunnels", false, Duration::from_millis(3));
        metrics.set_leader("tunnels", true);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap_or_default();
        assert!(
            text.contains(r#"reconcile_total{controller="tunnels",result="ok"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"reconcile_total{controller="tunnels",result="error"} 1"#));
        assert!(text.contains(r#"leader{controller="tunnels"} 1"#));
        assert!(text.contains("reconcile_duration_seconds_count"));
        assert_eq!(metrics.reconcile_count("tunnels", true), 1);
    }
}
