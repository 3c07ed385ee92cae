//! The node cut off from the API server: steward's endpoints converge when the link is back.

use std::time::{Duration, Instant};

use anyhow::Context as _;

use crate::e2e::partition::{CONVERGE_LIMIT, CUT, PROBE_EVERY, STEWARD_CUT};
use crate::e2e::{ChartReport, Env, url_port};

use super::clients::service_client;
use super::release::Release;

/// Cuts the node's link to the API server for [`CUT`] under steward and records
/// [`STEWARD_CUT`].
pub(super) async fn partition(env: &Env<'_>, report: &mut ChartReport, release: &Release) {
    let started = Instant::now();
    let outcome = partition_converges(env, release).await;
    report.record(
        STEWARD_CUT,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );
}

async fn partition_converges(env: &Env<'_>, release: &Release) -> anyhow::Result<String> {
    let node = env.plane.node().context("the control plane has no node")?;
    let port = url_port(env.plane.server_url())?;
    let through_steward = service_client(env).await?;
    let ask = || async {
        tokio::time::timeout(Duration::from_secs(5), through_steward.apiserver_version())
            .await
            .map_err(|_| anyhow::anyhow!("no answer within 5 s"))?
            .map_err(anyhow::Error::from)
    };
    ask().await.context("through steward before the cut")?;
    node.cut_apiserver_link(port)?;
    let cut_at = Instant::now();
    // During the cut steward has no upstream: a request through it must fail (else the cut did
    // not cut). Pods are read through the host's own link, which the cut leaves alone.
    let during = ask().await;
    let mut ready_counts = Vec::new();
    let mut read = Ok(());
    while cut_at.elapsed() < CUT {
        match release.ready_pods().await {
            Ok(ready) => ready_counts.push(ready.len()),
            Err(e) => {
                read = Err(e);
                break;
            }
        }
        tokio::time::sleep(PROBE_EVERY).await;
    }
    node.restore_apiserver_link()?;
    let returned_at = Instant::now();
    read?;
    if let Ok(version) = during {
        anyhow::bail!(
            "during the cut a request through steward was answered ({}): the link was not cut",
            version.git_version
        );
    }
    let mut back = None;
    while back.is_none() && returned_at.elapsed() < CONVERGE_LIMIT {
        match ask().await {
            Ok(_) => back = Some(returned_at.elapsed()),
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
    let back = back.with_context(|| {
        format!("no answer through steward within {CONVERGE_LIMIT:?} of the link's return")
    })?;
    release.wait_published("pod-ip", CONVERGE_LIMIT).await?;
    let published = returned_at.elapsed();
    Ok(format!(
        "during the cut a request through 10.96.0.1:443 failed ({}), ready steward Pods every {PROBE_EVERY:?}: {ready_counts:?}; after the link returned: answered through steward after {back:.1?}, default/kubernetes as pod-ip says by {published:.1?}; now {}",
        during.err().map(|e| format!("{e:#}")).unwrap_or_default(),
        release.published().await?.describe()
    ))
}
