//! Bytes through a tunnel's public address.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use kube::api::Api;
use rstream_operator::api::RstreamTunnel;

use crate::node::check;

use super::engine::EngineView;

/// Writes `len` pseudo-random bytes through `addr` (an echo behind a tunnel) while reading them
/// back; fails unless every byte returns in order.
pub(super) async fn echo_bulk(addr: SocketAddr, len: usize) -> anyhow::Result<Duration> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let data: Vec<u8> = (0..len as u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let started = Instant::now();
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut read, mut write) = stream.into_split();
    let sent = data.clone();
    let writer = tokio::spawn(async move {
        write.write_all(&sent).await?;
        write.shutdown().await?;
        anyhow::Ok(())
    });
    let mut back = Vec::with_capacity(len);
    tokio::time::timeout(Duration::from_secs(120), read.read_to_end(&mut back))
        .await
        .context("echo did not finish within 120 s")??;
    writer.await??;
    if back.len() != len {
        bail!("{} of {len} bytes came back", back.len());
    }
    if let Some(at) = back.iter().zip(&data).position(|(a, b)| a != b) {
        bail!("byte {at} differs");
    }
    Ok(started.elapsed())
}

/// `GET /` at `addr`: the workload Pod's answer (its last line), or why there was none.
pub(super) async fn workload_answer(addr: SocketAddr) -> Result<String, String> {
    match check::http_get(addr, "/").await {
        Ok(body) if body.contains("\"pod\":\"web-") => {
            Ok(body.lines().last().unwrap_or_default().to_owned())
        }
        Ok(body) => Err(format!(
            "an answer without the workload Pod: {}",
            body.chars().take(200).collect::<String>()
        )),
        Err(e) => Err(e),
    }
}

/// How long traffic may take to flow again after a step (the agent reconnecting, kube-proxy).
pub(super) const TRAFFIC_LIMIT: Duration = Duration::from_secs(60);

/// Bytes through both tunnels of [`tunnel_scenarios`] after a step: `GET /` through `web` until
/// the workload Pod answers, then 1 MiB through `echo` and back intact, each within
/// [`TRAFFIC_LIMIT`]; the ingress is looked up from the tunnel's status each try (an engine
/// restart makes new tunnels).
pub(super) async fn traffic(
    tunnels: &Api<RstreamTunnel>,
    engine: &(impl EngineView + ?Sized),
) -> anyhow::Result<String> {
    let started = Instant::now();
    let ingress = |t: RstreamTunnel| {
        let id = t.status.and_then(|s| s.tunnel_id).unwrap_or_default();
        engine
            .ingress_addr(&id)
            .ok_or_else(|| format!("the engine has no ingress for tunnel {id:?}"))
    };
    let mut tries = 0u32;
    let answer = loop {
        tries += 1;
        let last = match ingress(tunnels.get("web").await?) {
            Ok(addr) => match workload_answer(addr).await {
                Ok(answer) => break answer,
                Err(e) => e,
            },
            Err(e) => e,
        };
        if started.elapsed() > TRAFFIC_LIMIT {
            bail!(
                "no answer from the workload through tunnel web within {TRAFFIC_LIMIT:?} ({tries} tries): {last}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let http_after = started.elapsed();
    let (echoed, echo_tries) = echo_through(tunnels, engine, "echo", 1 << 20).await?;
    Ok(format!(
        "GET / through web answered by the workload after {http_after:.1?} (try {tries}: {answer}); 1 MiB through echo intact in {echoed:.2?} (try {echo_tries})"
    ))
}

/// `len` bytes through TCP tunnel `name` (its ingress looked up from its status each try) and
/// back intact, on a new connection, within [`TRAFFIC_LIMIT`]; returns the echo's time and the
/// tries it took.
pub(super) async fn echo_through(
    tunnels: &Api<RstreamTunnel>,
    engine: &(impl EngineView + ?Sized),
    name: &str,
    len: usize,
) -> anyhow::Result<(Duration, u32)> {
    let started = Instant::now();
    let mut tries = 0u32;
    loop {
        tries += 1;
        let id = (tunnels.get(name).await?.status)
            .and_then(|s| s.tunnel_id)
            .unwrap_or_default();
        let last = match engine.ingress_addr(&id) {
            Some(addr) => match echo_bulk(addr, len).await {
                Ok(took) => return Ok((took, tries)),
                Err(e) => format!("{e:#}"),
            },
            None => format!("the engine has no ingress for tunnel {id:?}"),
        };
        if started.elapsed() > TRAFFIC_LIMIT {
            bail!(
                "{len} bytes did not come back through tunnel {name} within {TRAFFIC_LIMIT:?} ({tries} tries): {last}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
