//! Token rotation: the agents log in again with the new token, the old one revoked.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use rstream_client::tls::TlsOptions;
use rstream_operator::api::RstreamTunnel;
use rstream_operator::names;
use serde_json::json;

use super::condition;
use super::engine::{EngineProcess, EngineView, Login, TOKEN, TOKEN_2, logins_text};

/// How long the rotation may take: the Secret change to both agents on the new token.
const ROTATION_LIMIT: Duration = Duration::from_secs(180);
/// How long an engine outage's effects (conditions, logins, Ready) may take to show.
pub(super) const OUTAGE_LIMIT: Duration = Duration::from_secs(90);

/// Waits until `engine` has at least `count` open control channels and every open one logged in
/// with `token`; returns when and the logins.
pub(super) async fn wait_logins(
    engine: &EngineProcess,
    token: &str,
    count: usize,
    limit: Duration,
) -> anyhow::Result<(Duration, String)> {
    let started = Instant::now();
    loop {
        let logins = engine.logins();
        let open: Vec<&Login> = logins.iter().filter(|l| l.open).collect();
        if open.len() >= count && open.iter().all(|l| l.token == token) {
            return Ok((started.elapsed(), logins_text(&logins)));
        }
        if started.elapsed() > limit {
            bail!(
                "within {limit:?}, not {count} open control channels all with token {token}: logins {}",
                logins_text(&logins)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Rotates the token: the engine accepts [`TOKEN`] and [`TOKEN_2`], the Secret changes to
/// [`TOKEN_2`], both agents (web and echo) roll and log in with it; then the engine revokes
/// [`TOKEN`] and a login of our own with it must be refused. Returns the detail and the index of
/// the first login after the revocation.
pub(super) async fn rotate_token(
    tunnels: &Api<RstreamTunnel>,
    deployments: &Api<Deployment>,
    secrets: &Api<Secret>,
    engine: &mut EngineProcess,
) -> anyhow::Result<(String, usize)> {
    let agent = tunnels
        .get("web")
        .await?
        .status
        .and_then(|s| s.agent_deployment)
        .context("no agent Deployment in the status")?;
    let hash = |d: &Deployment| {
        d.spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.annotations.as_ref())
            .and_then(|a| a.get(names::CONFIG_HASH_ANNOTATION))
            .cloned()
            .unwrap_or_default()
    };
    let before = hash(&deployments.get(&agent).await?);
    let before_logins = engine.logins();
    if before_logins.iter().any(|l| l.open && l.token != TOKEN) {
        bail!(
            "before the rotation a channel is open without token {TOKEN}: {}",
            logins_text(&before_logins)
        );
    }
    engine.set_tokens(&[TOKEN, TOKEN_2]).await?;
    let mark = before_logins.len();
    secrets
        .patch(
            "rstream-credentials",
            &PatchParams::default(),
            &Patch::Merge(json!({ "stringData": { "token": TOKEN_2 } })),
        )
        .await?;
    let started = Instant::now();
    // Both agents on the new token: each open channel logged in with it (the old agents' channels
    // closed as their Pods went), and both tunnels Ready.
    loop {
        let logins = engine.logins();
        let open: Vec<&Login> = logins.iter().filter(|l| l.open).collect();
        let switched = open.len() >= 2 && open.iter().all(|l| l.token == TOKEN_2);
        if switched
            && condition(&tunnels.get("web").await?, "Ready").is_some_and(|(s, _, _)| s == "True")
            && condition(&tunnels.get("echo").await?, "Ready").is_some_and(|(s, _, _)| s == "True")
        {
            break;
        }
        if started.elapsed() > ROTATION_LIMIT {
            bail!(
                "within {ROTATION_LIMIT:?} of the Secret change the agents are not both on the new token: logins since the change {}; open channels {}",
                logins_text(&logins[mark..]),
                logins_text(&open.into_iter().cloned().collect::<Vec<_>>())
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let switched = started.elapsed();
    // Revoked: the engine refuses the old token from now on and closes any channel on it.
    let revoked_at = engine.logins().len();
    engine.set_tokens(&[TOKEN_2]).await?;
    let probe = rstream_client::Client::builder()
        .engine(engine.engine_address())
        .token(TOKEN)
        .tls(TlsOptions::new().ca_pem(engine.ca_pem().into_bytes()))
        .operation_timeout(Duration::from_secs(30))
        .connect_timeout(Duration::from_secs(30))
        .build()?
        .connect()
        .await;
    let probe = match probe {
        Err(err) if err.engine_code() == Some(rstream_client::EngineErrorCode::Unauthorized) => {
            format!("a login of ours with the old token refused ({err})")
        }
        Err(err) => {
            bail!("a login with the old token after the revocation failed otherwise: {err}")
        }
        Ok(control) => {
            let _ = control.close().await;
            bail!("the engine let a login with the revoked token {TOKEN} in");
        }
    };
    // The agents were restarted by the operator: the Deployment's config hash moved and it rolled.
    let after = hash(&deployments.get(&agent).await?);
    if after == before {
        bail!("both agents use the new token, yet the config hash stayed {before}");
    }
    let d = deployments.get(&agent).await?;
    let generation = d.metadata.generation.unwrap_or(0);
    let status = d.status.unwrap_or_default();
    if status.observed_generation != Some(generation) || status.updated_replicas != Some(1) {
        bail!("the agent Deployment {agent} has not rolled out: {status:?}");
    }
    Ok((
        format!(
            "config hash {before} -> {after}; both agents on {TOKEN_2} {switched:.1?} after the Secret changed (logins since: {}); {TOKEN} revoked, {probe}",
            logins_text(&engine.logins()[mark..])
        ),
        revoked_at,
    ))
}

/// After the revocation of [`TOKEN`]: no login with it was let in, and the open channels (at
/// least the two agents') all carry [`TOKEN_2`].
pub(super) fn after_revocation(
    engine: &EngineProcess,
    revoked_at: usize,
) -> anyhow::Result<String> {
    let logins = engine.logins();
    let since = &logins[revoked_at.min(logins.len())..];
    if let Some(l) = since.iter().find(|l| l.accepted && l.token == TOKEN) {
        bail!(
            "after the revocation the engine let {l} in: {}",
            logins_text(since)
        );
    }
    let open: Vec<Login> = logins.iter().filter(|l| l.open).cloned().collect();
    if open.len() < 2 || open.iter().any(|l| l.token != TOKEN_2) {
        bail!(
            "after the revocation the open channels are {} (want both agents on {TOKEN_2})",
            logins_text(&open)
        );
    }
    Ok(format!(
        "after the revocation: open channels {}, logins {}",
        logins_text(&open),
        logins_text(since)
    ))
}
