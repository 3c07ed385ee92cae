//! A mapping posted and timed to its first byte, and bulk bytes through one.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::ControlPlane;
use anyhow::{Context as _, bail};

use crate::bench::Settings;
use crate::bench::load::{self, Direction, Sink};
use crate::bench::report::Recorder;
use crate::bench::system::{self, GENERATOR_CPU};

use super::pods::{BannerPods, create_pod};
use super::proxier::Proxier;
use super::{
    DIRECT, DOWNLOAD, STEP_TIMEOUT, Sizes, TTL_SECONDS, UPLOAD, greeting, http, wait_idle,
};

/// Deletes the current mapping, waits until the entry port is idle, maps pod `next` and times
/// POST to first byte; then checks the greeting is that pod's.
pub(super) async fn map_and_time(
    proxier: &mut Proxier,
    banners: &BannerPods,
    next: usize,
) -> anyhow::Result<Duration> {
    if let Some(current) = proxier.mapped.take() {
        let path = format!("/api/v1/mapping?pod_name={}", banners.pod_name(current));
        let token = proxier.token.as_deref();
        let (status, body) = http(proxier.api, "DELETE", &path, None, token).await?;
        if status != 200 {
            bail!("DELETE {path} answered {status}: {body}");
        }
    }
    wait_idle(proxier.entry).await?;
    let body = serde_json::json!({"pod_name": banners.pod_name(next), "time": TTL_SECONDS});
    let elapsed = crate::fixtures::post_to_first_byte(
        proxier.api,
        "/api/v1/mapping",
        &body.to_string(),
        proxier.token.as_deref(),
        proxier.entry,
        STEP_TIMEOUT,
    )
    .await?;
    proxier.mapped = Some(next);
    let greeting = greeting(proxier.entry).await;
    if greeting.as_deref() != Some(banners.tag(next).as_str()) {
        bail!(
            "the entry port greets with {greeting:?}, not {}",
            banners.tag(next)
        );
    }
    Ok(elapsed)
}

/// Runs on its own thread, pinned to the generator CPU, with its own runtime (the sink's tasks
/// must run there too).
pub(super) fn throughput(
    settings: &Settings,
    sizes: &Sizes,
    plane: &ControlPlane,
    pods_ns: &str,
    entries: &[(&str, (SocketAddr, SocketAddr))],
    recorder: &mut Recorder,
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    system::with_cpu(GENERATOR_CPU, || {
        runtime.block_on(async {
            let sink = Sink::start().await?;
            let client = plane.client().await?;
            create_pod(&client, pods_ns, "bulk", sink.addr().port()).await?;
            let mut contenders = vec![(DIRECT, sink.addr())];
            for (name, (api, entry)) in entries {
                map_bulk_pod(*api, *entry, pods_ns)
                    .await
                    .with_context(|| format!("mapping the bulk pod through {name}"))?;
                contenders.push((name, *entry));
            }
            for (direction, metric) in
                [(Direction::Download, DOWNLOAD), (Direction::Upload, UPLOAD)]
            {
                for _ in 0..settings.rounds {
                    for (name, addr) in &contenders {
                        let elapsed = load::bulk(*addr, direction, 1, sizes.bulk_bytes)
                            .await
                            .with_context(|| format!("{} through {name}", metric.name))?;
                        let gbits = sizes.bulk_bytes as f64 * 8.0 / elapsed.as_secs_f64() / 1e9;
                        recorder.record(metric, name, gbits);
                    }
                }
            }
            anyhow::Ok(())
        })
    })?
}

/// Maps the bulk pod and waits until a small transfer passes (the sink does not greet).
async fn map_bulk_pod(api: SocketAddr, entry: SocketAddr, pods_ns: &str) -> anyhow::Result<()> {
    let body = serde_json::json!({"pod_name": format!("{pods_ns}/bulk"), "time": TTL_SECONDS});
    let (status, answer) = http(api, "POST", "/api/v1/mapping", Some(&body), None).await?;
    if status != 200 {
        bail!("POST /api/v1/mapping answered {status}: {answer}");
    }
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        match load::bulk(entry, Direction::Download, 1, 1 << 20).await {
            Ok(_) => return Ok(()),
            Err(error) if Instant::now() > deadline => return Err(error),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}
