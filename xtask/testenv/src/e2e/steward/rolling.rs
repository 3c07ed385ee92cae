//! `helm upgrade` rolls both Pods while a client lists and watches through steward.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::WatchParams;
use kube::api::{Api, DeleteParams, ListParams, PostParams, WatchEvent};
use serde_json::json;

use crate::e2e::Env;

use super::RELEASE;
use super::clients::service_client;
use super::release::Release;

pub(super) struct RollOutcome {
    pub(super) requests: u32,
    pub(super) failed: u32,
    pub(super) errors: Vec<String>,
    pub(super) watch_events: Vec<String>,
    pub(super) watch_errors: Vec<String>,
    pub(super) watch_restarts: u32,
    pub(super) watch_saw_probe: bool,
    pub(super) rollout: Duration,
    pub(super) old_pods_gone: Option<Duration>,
    /// The slowest GET (answered or not).
    pub(super) slowest: Duration,
    /// How long after its creation the watch delivered the last probe.
    pub(super) last_probe_seen: Option<Duration>,
}

impl RollOutcome {
    pub(super) fn describe(&self) -> String {
        format!(
            "rollout complete after {:.1}s, old Pods gone after {}; {} GETs, {} failed{}, slowest {} ms; watch: {} events [{}], {} re-watches{}, the last probe seen {}",
            self.rollout.as_secs_f64(),
            self.old_pods_gone
                .map(|d| format!("{:.1}s", d.as_secs_f64()))
                .unwrap_or_else(|| "(not within the limit)".to_owned()),
            self.requests,
            self.failed,
            if self.errors.is_empty() {
                String::new()
            } else {
                format!(" ({})", self.errors.join("; "))
            },
            self.slowest.as_millis(),
            self.watch_events.len(),
            self.watch_events.join(", "),
            self.watch_restarts,
            if self.watch_errors.is_empty() {
                String::new()
            } else {
                format!(", errors: {}", self.watch_errors.join("; "))
            },
            self.last_probe_seen
                .map(|d| format!("{} ms after its creation", d.as_millis()))
                .unwrap_or_else(|| "never (within 30 s)".to_owned()),
        )
    }
}

pub(super) async fn rolling_upgrade(
    env: &Env<'_>,
    cluster: &Release,
) -> anyhow::Result<RollOutcome> {
    let client = service_client(env).await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    cluster.wait_routed_through_steward().await?;
    let version = namespaces
        .list(&ListParams::default())
        .await
        .context("listing namespaces through 10.96.0.1")?
        .metadata
        .resource_version
        .unwrap_or_default();
    let old: BTreeSet<String> = cluster
        .all_pods()
        .await?
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let stop = tokio_util_stop();
    // The probes the watcher has seen so far, so the end can wait for the last one.
    let (seen_tx, mut seen_rx) = tokio::sync::watch::channel(BTreeSet::<String>::new());
    // The watcher: re-watches from the last version after any end or error.
    let watcher = {
        let namespaces = namespaces.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut version = version;
            let mut events = Vec::new();
            let mut errors = Vec::new();
            let mut restarts = 0u32;
            let mut saw_probe = false;
            while !stop.is_stopped() && restarts < 100 {
                let params = WatchParams::default().timeout(120);
                match namespaces.watch(&params, &version).await {
                    Ok(stream) => {
                        let mut stream = std::pin::pin!(stream);
                        loop {
                            let next = tokio::select! {
                                next = stream.next() => next,
                                () = stop.wait() => None,
                            };
                            match next {
                                Some(Ok(
                                    WatchEvent::Added(ns)
                                    | WatchEvent::Modified(ns)
                                    | WatchEvent::Deleted(ns),
                                )) => {
                                    let name = ns.metadata.name.clone().unwrap_or_default();
                                    if name.starts_with("e2e-roll-probe") {
                                        saw_probe = true;
                                        events.push(name.clone());
                                        seen_tx.send_modify(|seen| {
                                            seen.insert(name.clone());
                                        });
                                    }
                                    version = ns.metadata.resource_version.unwrap_or(version);
                                }
                                Some(Ok(WatchEvent::Bookmark(b))) => {
                                    version = b.metadata.resource_version;
                                }
                                Some(Ok(WatchEvent::Error(e))) => {
                                    errors.push(format!("{} {}", e.code, e.message));
                                    break;
                                }
                                Some(Err(e)) => {
                                    errors.push(e.to_string().chars().take(120).collect());
                                    break;
                                }
                                None => break,
                            }
                        }
                    }
                    Err(e) => {
                        errors.push(e.to_string().chars().take(120).collect());
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                restarts += 1;
            }
            (events, errors, restarts.saturating_sub(1), saw_probe)
        })
    };
    // The GET loop.
    let getter = {
        let client = client.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let api: Api<Namespace> = Api::all(client);
            let mut requests = 0u32;
            let mut failed = 0u32;
            let mut errors: Vec<String> = Vec::new();
            let mut slowest = Duration::ZERO;
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            while !stop.is_stopped() && requests < 10_000 {
                tick.tick().await;
                requests += 1;
                let sent = Instant::now();
                let answer =
                    tokio::time::timeout(Duration::from_secs(30), api.get("default")).await;
                slowest = slowest.max(sent.elapsed());
                match answer {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        failed += 1;
                        if errors.len() < 5 {
                            errors.push(e.to_string().chars().take(120).collect());
                        }
                    }
                    Err(_) => {
                        failed += 1;
                        if errors.len() < 5 {
                            errors.push("timed out after 30 s".to_owned());
                        }
                    }
                }
            }
            (requests, failed, errors, slowest)
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let admin: Api<Namespace> = Api::all(env.plane.client().await?);
    let probe = |n: u32| -> anyhow::Result<Namespace> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": { "name": format!("e2e-roll-probe-{n}") },
        }))?)
    };
    admin.create(&PostParams::default(), &probe(1)?).await?;
    let started = Instant::now();
    let sets = [("--set-string", "podAnnotations.e2e-roll=1")];
    env.upgrade_reusing(RELEASE, &cluster.ns, &sets, false)
        .await?;
    admin.create(&PostParams::default(), &probe(2)?).await?;
    cluster.wait_rolled_out(Duration::from_secs(180)).await?;
    let rollout = started.elapsed();
    admin.create(&PostParams::default(), &probe(3)?).await?;
    let mut old_pods_gone = None;
    let limit = Duration::from_secs(90);
    while started.elapsed() < limit {
        let now: BTreeSet<String> = cluster
            .all_pods()
            .await?
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        if now.is_disjoint(&old) {
            old_pods_gone = Some(started.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster
        .wait_published("pod-ip", Duration::from_secs(30))
        .await?;
    admin.create(&PostParams::default(), &probe(4)?).await?;
    // The watch has its chance at the last probe: wait (bounded) until it saw an event per probe
    // created, or ended; a missing one fails the scenario below.
    let created = Instant::now();
    let last_probe_seen = tokio::time::timeout(
        Duration::from_secs(30),
        seen_rx.wait_for(|seen| seen.contains("e2e-roll-probe-4")),
    )
    .await
    .ok()
    .and_then(Result::ok)
    .map(|_| created.elapsed());
    stop.stop();
    let (requests, failed, errors, slowest) = getter.await?;
    let (watch_events, watch_errors, watch_restarts, _) = watcher.await?;
    for n in 1..=4 {
        let _ = admin
            .delete(&format!("e2e-roll-probe-{n}"), &DeleteParams::default())
            .await;
    }
    let watch_saw_probe = (1..=4).all(|n| {
        watch_events
            .iter()
            .any(|e| e == &format!("e2e-roll-probe-{n}"))
    });
    Ok(RollOutcome {
        requests,
        failed,
        errors,
        watch_events,
        watch_errors,
        watch_restarts,
        watch_saw_probe,
        rollout,
        old_pods_gone,
        slowest,
        last_probe_seen,
    })
}

/// A stop flag tasks can poll or await.
#[derive(Clone)]
struct Stop(std::sync::Arc<tokio::sync::watch::Sender<bool>>);

fn tokio_util_stop() -> Stop {
    Stop(std::sync::Arc::new(tokio::sync::watch::channel(false).0))
}

impl Stop {
    fn stop(&self) {
        self.0.send_replace(true);
    }

    fn is_stopped(&self) -> bool {
        *self.0.borrow()
    }

    async fn wait(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|v| *v).await;
    }
}
