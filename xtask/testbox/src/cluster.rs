//! `kube`: talks to the API server the way a pod's controller would, through in-cluster config
//! (KUBERNETES_SERVICE_HOST/PORT, the projected ServiceAccount token and CA).

use std::time::Duration;

use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use kube::{Client, Config, ResourceExt as _};
use tokio::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// What to list.
    #[arg(long, value_enum, default_value_t = Kind::Namespaces)]
    pub list: Kind,
    /// After listing, hold a watch this many seconds and print every event (0: no watch).
    #[arg(long, default_value_t = 0)]
    pub watch_seconds: u64,
    /// Use only the in-cluster config; without it a kubeconfig (KUBECONFIG, ~/.kube/config) is
    /// tried first, as kube::Client::try_default does.
    #[arg(long, env = "TESTBOX_IN_CLUSTER")]
    pub in_cluster: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum Kind {
    Namespaces,
}

/// The API server ends a watch after at most this long; we then watch again from where it ended.
const WATCH_CALL_SECONDS: u64 = 290;

pub async fn run(args: Args) -> anyhow::Result<()> {
    let config = if args.in_cluster {
        Config::incluster().context("in-cluster config")?
    } else {
        Config::infer()
            .await
            .context("inferring the client config")?
    };
    eprintln!("kube: API server {}", config.cluster_url);
    let client = Client::try_from(config).context("building the client")?;
    let Kind::Namespaces = args.list;
    let api: Api<Namespace> = Api::all(client);
    let list = api
        .list(&ListParams::default())
        .await
        .context("listing namespaces")?;
    for namespace in &list {
        println!("namespace {}", namespace.name_any());
    }
    let mut events = 0u64;
    if args.watch_seconds > 0 {
        let version = list.metadata.resource_version.clone().unwrap_or_default();
        events = watch(&api, version, Duration::from_secs(args.watch_seconds)).await?;
    }
    println!(
        "kube result=ok namespaces={} events={events}",
        list.items.len()
    );
    Ok(())
}

/// Watches from `version` until `duration` has passed; any error event or failed call fails.
async fn watch(
    api: &Api<Namespace>,
    mut version: String,
    duration: Duration,
) -> anyhow::Result<u64> {
    let deadline = Instant::now() + duration;
    let mut events = 0;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(events);
        }
        let call_seconds = left.as_secs().clamp(1, WATCH_CALL_SECONDS);
        let params = WatchParams::default().timeout(u32::try_from(call_seconds).unwrap_or(1));
        let stream = api
            .watch(&params, &version)
            .await
            .context("starting the namespace watch")?;
        let mut stream = std::pin::pin!(stream);
        loop {
            let next = match tokio::time::timeout_at(deadline, stream.next()).await {
                Ok(next) => next,
                Err(_) => return Ok(events),
            };
            let event = match next {
                // The server ended this call; the outer loop watches again if time is left.
                None => break,
                Some(event) => event.context("namespace watch")?,
            };
            let (kind, namespace) = match event {
                WatchEvent::Added(ns) => ("ADDED", ns),
                WatchEvent::Modified(ns) => ("MODIFIED", ns),
                WatchEvent::Deleted(ns) => ("DELETED", ns),
                WatchEvent::Bookmark(bookmark) => {
                    version = bookmark.metadata.resource_version;
                    continue;
                }
                WatchEvent::Error(status) => {
                    bail!("namespace watch: {} ({})", status.message, status.code)
                }
            };
            if let Some(v) = namespace.resource_version() {
                version = v;
            }
            events += 1;
            println!("event {kind} {}", namespace.name_any());
        }
    }
}
