//! pod-proxier's own Prometheus metrics (the relay's come from proxy-core, the leader gauge from
//! k8s-reconcile).

use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::crd::{MappingKind, PortMapping};

/// Labels naming a mapping kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// `pod` or `service`.
    pub kind: String,
}

/// Labels naming an entry port.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EntryLabels {
    /// The entry port.
    pub entry_port: u16,
}

/// Labels of an API answer.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The route, e.g. `POST /api/v1/mapping`.
    pub route: String,
    /// The HTTP status.
    pub status: u16,
}

/// The metrics, cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    /// Active mappings by kind.
    pub mappings: Family<KindLabels, Gauge>,
    /// Free ports left in the V2 range.
    pub v2_ports_free: Gauge,
    /// Times a Service port found the V2 range full.
    pub v2_port_exhausted: Counter,
    /// Entry ports the data plane could not program.
    pub listener_errors: Counter,
    /// API answers.
    pub requests: Family<RequestLabels, Counter>,
    /// Clients of a V1 entry port refused at accept because the mapping does not admit their
    /// source, per entry port.
    pub source_refused: Family<EntryLabels, Counter>,
}

impl Metrics {
    /// Registers everything under `podproxier_*`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            mappings: Family::default(),
            v2_ports_free: Gauge::default(),
            v2_port_exhausted: Counter::default(),
            listener_errors: Counter::default(),
            requests: Family::default(),
            source_refused: Family::default(),
        };
        let sub = registry.sub_registry_with_prefix("podproxier");
        sub.register(
            "mappings",
            "Active port mappings by kind",
            metrics.mappings.clone(),
        );
        sub.register(
            "v2_ports_free",
            "Free ports left in the V2 port range",
            metrics.v2_ports_free.clone(),
        );
        sub.register(
            "v2_port_range_exhausted",
            "Service ports that found the V2 port range full",
            metrics.v2_port_exhausted.clone(),
        );
        sub.register(
            "listener_errors",
            "Entry ports the data plane could not program",
            metrics.listener_errors.clone(),
        );
        sub.register(
            "api_requests",
            "HTTP API answers by route and status",
            metrics.requests.clone(),
        );
        sub.register(
            "entry_source_refused",
            "Clients of a V1 entry port closed at accept because the mapping does not admit their source address",
            metrics.source_refused.clone(),
        );
        metrics
    }

    /// Recounts the active mappings.
    pub fn set_mapping_counts(&self, mappings: &[Arc<PortMapping>], now: Timestamp) {
        for kind in [MappingKind::Pod, MappingKind::Service] {
            let count = mappings
                .iter()
                .filter(|m| m.spec.kind == kind && !m.is_expired(now))
                .count();
            self.mappings
                .get_or_create(&KindLabels {
                    kind: kind.label().to_owned(),
                })
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
    }
}
