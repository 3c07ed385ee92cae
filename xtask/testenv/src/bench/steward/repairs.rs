//! Edits of the `default/kubernetes` EndpointSlice and the time until each is repaired.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use tokio::sync::mpsc;

use super::{EDIT_SPACING, SERVICE_PORT, random_fraction};

/// Whether the slice publishes exactly `expected` on the service port.
pub(super) fn is_repaired(slice: &EndpointSlice, expected: &[String]) -> bool {
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

pub(super) async fn wait_published(
    client: &kube::Client,
    expected: &[String],
) -> anyhow::Result<()> {
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
pub(super) enum EditTiming {
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
pub(super) async fn drift_repairs(
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
