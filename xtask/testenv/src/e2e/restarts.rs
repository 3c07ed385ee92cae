//! Container restart counts, watched across a chart's run.

use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};

use super::report::Restarts;
use crate::ControlPlane;

/// Samples every container's restart count in some namespaces once a second from its start
/// until [`RestartWatch::finish`], keeping each container's highest count: a Pod that crash-looped
/// during an outage and was deleted later still counts. A failed sample is an error, never
/// zero restarts.
pub struct RestartWatch {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<anyhow::Result<Vec<Restarts>>>,
}

impl RestartWatch {
    /// Starts watching the containers of `namespaces` for restarts.
    pub async fn start(plane: &ControlPlane, namespaces: &[&str]) -> anyhow::Result<Self> {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let client = plane.client().await?;
        let namespaces: Vec<String> = namespaces.iter().map(|n| (*n).to_owned()).collect();
        let task = tokio::spawn(async move {
            let mut highest = Highest::new();
            loop {
                // One last sample after the stop, so the end state counts too.
                let last = *stopped.borrow();
                for ns in &namespaces {
                    let sample = restarts(&client, ns)
                        .await
                        .with_context(|| format!("sampling restart counts in {ns}"))?;
                    keep_highest(&mut highest, sample);
                }
                if last {
                    break;
                }
                // A dropped watch (its chart stopped by an error) stops sampling too.
                if let Ok(Err(_)) =
                    tokio::time::timeout(Duration::from_secs(1), stopped.changed()).await
                {
                    break;
                }
            }
            Ok(highest
                .into_iter()
                .map(|((pod, container), restarts)| Restarts {
                    pod,
                    container,
                    restarts,
                })
                .collect())
        });
        Ok(Self { stop, task })
    }

    /// Every container seen since the start, each with its highest restart count.
    pub async fn finish(self) -> anyhow::Result<Vec<Restarts>> {
        self.stop.send_replace(true);
        self.task.await.context("the restart sampler")?
    }
}

/// Each container's highest restart count so far, by Pod and container name.
type Highest = std::collections::BTreeMap<(String, String), i32>;

/// Folds one sample into `highest`: a container keeps its highest count, and a Pod no longer
/// listed keeps the count it had. A Pod deleted and replaced by its controller is a new name
/// starting at 0, not a restart; a crash loop raises the same container's count.
fn keep_highest(highest: &mut Highest, sample: Vec<Restarts>) {
    for r in sample {
        let count = highest.entry((r.pod, r.container)).or_insert(0);
        *count = (*count).max(r.restarts);
    }
}

/// Every container's restart count in `ns`.
pub(super) async fn restarts(client: &kube::Client, ns: &str) -> anyhow::Result<Vec<Restarts>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut out = Vec::new();
    for pod in pods.list(&ListParams::default()).await? {
        let name = pod.metadata.name.clone().unwrap_or_default();
        for status in pod
            .status
            .and_then(|s| s.container_statuses)
            .unwrap_or_default()
        {
            out.push(Restarts {
                pod: name.clone(),
                container: status.name,
                restarts: status.restart_count,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(counts: &[(&str, i32)]) -> Vec<Restarts> {
        counts
            .iter()
            .map(|(pod, restarts)| Restarts {
                pod: (*pod).to_owned(),
                container: "agent".to_owned(),
                restarts: *restarts,
            })
            .collect()
    }

    fn counts(highest: &Highest) -> Vec<(&str, i32)> {
        highest.iter().map(|((p, _), r)| (p.as_str(), *r)).collect()
    }

    #[test]
    fn a_replaced_pod_is_no_restart() {
        let mut highest = Highest::new();
        keep_highest(&mut highest, sample(&[("agent-a", 0)]));
        // agent-a killed; its Deployment's agent-b takes over.
        keep_highest(&mut highest, sample(&[("agent-b", 0)]));
        keep_highest(&mut highest, sample(&[("agent-b", 0)]));
        assert_eq!(counts(&highest), [("agent-a", 0), ("agent-b", 0)]);
    }

    #[test]
    fn a_crash_loop_counts_even_after_its_pod_is_gone() {
        let mut highest = Highest::new();
        keep_highest(&mut highest, sample(&[("agent-a", 0)]));
        keep_highest(&mut highest, sample(&[("agent-a", 2)]));
        // A later sample with a lower count (a replaced Pod of the same name) lowers nothing.
        keep_highest(&mut highest, sample(&[("agent-a", 0)]));
        keep_highest(&mut highest, sample(&[("agent-b", 1)]));
        assert_eq!(counts(&highest), [("agent-a", 2), ("agent-b", 1)]);
    }
}
