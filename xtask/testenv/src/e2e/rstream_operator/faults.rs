//! An agent Pod killed, and a live stream while the engine is killed.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use rstream_operator::api::RstreamTunnel;

use crate::node::check;

use super::engine::{EngineView, wait_ingress};
use super::traffic::echo_through;
use super::{agent_pods, condition, wait_condition};

/// How long a killed agent's replacement may take to bring its tunnel back.
const AGENT_REPLACED_LIMIT: Duration = Duration::from_secs(90);

/// Kills tunnel `name`'s agent Pod (grace 0) while the tunnel is Ready; the Deployment's
/// replacement must bring it back: a new agent Pod (another uid) Ready with no container
/// restarted, the tunnel Ready with a new tunnel id (the one the new agent opened), then 1 MiB
/// through it on a new connection. Ok is the detail.
pub(super) async fn kill_agent(
    client: &kube::Client,
    ns: &str,
    tunnels: &Api<RstreamTunnel>,
    engine: &(impl EngineView + ?Sized),
    name: &str,
) -> anyhow::Result<String> {
    let before = wait_condition(tunnels, name, "Ready", "True", Duration::from_secs(60)).await?;
    let old_id = (before.status.and_then(|s| s.tunnel_id)).context("no tunnel id in the status")?;
    let (deployment, pods) = agent_pods(client, ns, name).await?;
    let [victim] = pods.as_slice() else {
        bail!(
            "{} agent Pods of {deployment} before the kill, want 1",
            pods.len()
        );
    };
    let victim_name = victim.metadata.name.clone().unwrap_or_default();
    let victim_uid = victim.metadata.uid.clone().unwrap_or_default();
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let killed = Instant::now();
    pods_api
        .delete(&victim_name, &DeleteParams::default().grace_period(0))
        .await?;
    // The tunnel's Ready as sampled meanwhile (the first not-True one, when seen).
    let mut not_ready: Option<(String, Duration)> = None;
    let (replacement, new_id) = loop {
        let t = tunnels.get(name).await?;
        let ready = condition(&t, "Ready");
        if let Some((status, reason, _)) = &ready
            && status != "True"
            && not_ready.is_none()
        {
            not_ready = Some((format!("{status} ({reason})"), killed.elapsed()));
        }
        let id = t.status.and_then(|s| s.tunnel_id).unwrap_or_default();
        let (_, pods) = agent_pods(client, ns, name).await?;
        let new = pods
            .into_iter()
            .find(|p| p.metadata.uid.as_deref() != Some(victim_uid.as_str()) && check::is_ready(p));
        if let Some(new) = new
            && ready.as_ref().is_some_and(|(s, _, _)| s == "True")
            && id != old_id
        {
            break (new, id);
        }
        if killed.elapsed() > AGENT_REPLACED_LIMIT {
            bail!(
                "within {AGENT_REPLACED_LIMIT:?} of killing {victim_name}: Ready {ready:?}, tunnel id {id:?} (was {old_id:?}), agent Pods {:?}",
                agent_pods(client, ns, name)
                    .await?
                    .1
                    .iter()
                    .map(|p| p.metadata.name.clone().unwrap_or_default())
                    .collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let ready_after = killed.elapsed();
    let replacement_name = replacement.metadata.name.clone().unwrap_or_default();
    let restarts: Vec<(String, i32)> = (replacement.status.and_then(|s| s.container_statuses))
        .unwrap_or_default()
        .into_iter()
        .map(|c| (c.name, c.restart_count))
        .collect();
    if restarts.iter().any(|(_, r)| *r != 0) {
        bail!("the replacement agent {replacement_name} restarted: {restarts:?}");
    }
    let (echoed, tries) = echo_through(tunnels, engine, name, 1 << 20).await?;
    Ok(format!(
        "killed {victim_name} (grace 0); replacement {replacement_name} Ready, tunnel Ready again with id {old_id} -> {new_id} after {ready_after:.1?}; \
         Ready seen not True meanwhile: {}; the replacement's restarts {restarts:?}; then 1 MiB through {name} intact in {echoed:.2?} (try {tries})",
        match &not_ready {
            Some((status, at)) => format!("{status} at {at:.1?}"),
            None => "never (sampled every 200 ms)".to_owned(),
        }
    ))
}

/// Bytes the live stream of the engine outage echoes before and after.
pub(super) const LIVE_BYTES: usize = 64 * 1024;
/// How soon the client must see a live stream end once the engine is killed (the kernel resets
/// its connections at once; generous for a busy machine, the time is reported).
pub(super) const LIVE_END_LIMIT: Duration = Duration::from_secs(30);

/// Connects to TCP tunnel `name`'s ingress and echoes `len` bytes on that connection (within
/// 30 s), leaving it open.
pub(super) async fn open_stream(
    tunnels: &Api<RstreamTunnel>,
    engine: &(impl EngineView + ?Sized),
    name: &str,
    len: usize,
) -> anyhow::Result<tokio::net::TcpStream> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let id = (tunnels.get(name).await?.status)
        .and_then(|s| s.tunnel_id)
        .unwrap_or_default();
    let addr = (wait_ingress(engine, &id).await)
        .with_context(|| format!("the engine has no ingress for tunnel {id:?}"))?;
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream.write_all(&data).await?;
        let mut back = vec![0; len];
        stream.read_exact(&mut back).await?;
        anyhow::Ok((stream, back))
    };
    let (stream, back) = tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .with_context(|| format!("no echo of {len} bytes through {addr} within 30 s"))??;
    if back != data {
        bail!("the echo through {addr} differs");
    }
    Ok(stream)
}

/// Reads until the stream ends; returns when, and how: EOF or the error (with any bytes that
/// came after the echo).
pub(super) async fn stream_end(mut read: tokio::net::tcp::OwnedReadHalf) -> (Instant, String) {
    use tokio::io::AsyncReadExt as _;
    let mut buf = vec![0; 16 * 1024];
    let mut extra = 0;
    loop {
        match read.read(&mut buf).await {
            Ok(0) => {
                return (
                    Instant::now(),
                    format!("EOF ({extra} unexpected bytes first)"),
                );
            }
            Ok(n) => extra += n,
            Err(e) => {
                return (
                    Instant::now(),
                    format!("error {e} ({extra} unexpected bytes first)"),
                );
            }
        }
    }
}
