//! The tunnel scenarios, from the Quick Start to the tunnel's deletion.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::bail;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DeleteParams, ListParams};
use rstream_client::engine::EngineIdentity;
use rstream_operator::api::RstreamTunnel;
use rstream_operator::names;

use crate::e2e::{ChartReport, Env};
use crate::node;

use super::engine::{
    EngineProcess, TOKEN, TOKEN_2, build_engine_process, logins_text, wait_ingress,
};
use super::faults::{LIVE_BYTES, LIVE_END_LIMIT, kill_agent, open_stream, stream_end};
use super::quick_start::{http_tunnel, quick_start};
use super::rotation::{OUTAGE_LIMIT, after_revocation, rotate_token, wait_logins};
use super::service_lb::service_load_balancer;
use super::traffic::{echo_bulk, echo_through, traffic};
use super::{
    AGENT_KILLED, AGENT_METRICS, ENGINE_KILLED, HTTP_TUNNEL, SERVICE_LB, TCP_TUNNEL, TOKEN_ROTATED,
    TUNNEL_DELETED, agent_pod_ip, condition, engine_killed_live, http_tunnel_spec, tcp_tunnel_spec,
    wait_condition,
};

/// The seed's Quick Start on the node: a workload behind a Service, an RstreamConnection with
/// the engine's CA by Secret reference, an HTTP and a TCP tunnel; then rotation, an engine
/// outage and deletion. The engine is a process of its own (SIGKILLed in the outage) accepting
/// only the Secret's token.
pub(super) async fn tunnel_scenarios(
    env: &Env<'_>,
    report: &mut ChartReport,
    ns: &str,
) -> anyhow::Result<()> {
    let client = env.plane.client().await?;
    let started = Instant::now();
    let bin = build_engine_process().await?;
    let dir = tempfile::tempdir()?;
    let identity_file = dir.path().join("engine-identity.json");
    let identity = EngineIdentity::generate_for(&[&node::HOST_IP.to_string()])?;
    std::fs::write(&identity_file, identity.to_json())?;
    let mut engine = EngineProcess::start(
        &bin,
        SocketAddr::new(node::HOST_IP.into(), 0),
        &identity_file,
        identity.ca_pem(),
        &[TOKEN],
    )
    .await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let tunnels: Api<RstreamTunnel> = Api::namespaced(client.clone(), ns);
    quick_start(
        &client,
        ns,
        &engine,
        &[("web", http_tunnel_spec()), ("echo", tcp_tunnel_spec())],
    )
    .await?;

    // 1. The agent Deployment becomes Available by its own probe; the tunnel is Ready; a request
    //    to the engine's ingress reaches the workload Pod through the Service's DNS name.
    let outcome = match http_tunnel(env, &engine, ns, "web").await {
        Ok(web) => (web.passed(), web.describe()),
        Err(err) => (false, format!("{err:#}")),
    };
    report.record(HTTP_TUNNEL, outcome.0, started, outcome.1);

    // 2. 64 MiB through a TCP tunnel, intact.
    let started = Instant::now();
    let outcome =
        match wait_condition(&tunnels, "echo", "Ready", "True", Duration::from_secs(90)).await {
            Ok(t) => {
                let tunnel_id = t.status.and_then(|s| s.tunnel_id).unwrap_or_default();
                match wait_ingress(&engine, &tunnel_id).await {
                    Some(ingress) => echo_bulk(ingress, 64 << 20).await,
                    None => Err(anyhow::anyhow!("the engine has no ingress for {tunnel_id}")),
                }
            }
            Err(err) => Err(err),
        };
    report.record(
        TCP_TUNNEL,
        outcome.is_ok(),
        started,
        match outcome {
            Ok(took) => format!(
                "64 MiB each way in {took:.2?} ({:.0} MiB/s)",
                64.0 / took.as_secs_f64()
            ),
            Err(err) => format!("{err:#}"),
        },
    );

    // A Service as the way in: the manager's Service controller, on the node.
    let started = Instant::now();
    let outcome = service_load_balancer(&client, ns).await;
    report.record(
        SERVICE_LB,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );

    // The echo tunnel's agent counted what it carried, under the names its README lists.
    match agent_pod_ip(&client, ns, "echo").await {
        Ok(ip) => {
            let port = u16::try_from(rstream_operator::manager::children::HEALTH_PORT)?;
            let addr = SocketAddr::new(ip, port);
            crate::e2e::record_metric_names(
                report,
                AGENT_METRICS,
                &crate::e2e::Scrape::Open(addr),
                "rstream-agent",
                &[
                    "rstream_agent_tunnel_online",
                    "rstream_agent_streams",
                    "rstream_agent_stream_bytes",
                ],
            )
            .await;
        }
        Err(err) => report.record(AGENT_METRICS, false, Instant::now(), format!("{err:#}")),
    }

    // 3. Token rotation: the engine accepts both tokens, the Secret changes, the agents roll
    //    (config hash) and log in with the new token; then the engine revokes the old one (any
    //    channel still on it is closed, a login with it refused) and both tunnels carry traffic.
    let started = Instant::now();
    let outcome = match rotate_token(&tunnels, &deployments, &secrets, &mut engine).await {
        Ok((rotated, revoked_at)) => match traffic(&tunnels, &engine).await {
            Ok(sent) => after_revocation(&engine, revoked_at)
                .map(|logins| format!("{rotated}; then {sent}; {logins}")),
            Err(err) => Err(err.context(format!(
                "{rotated}; logins since the revocation: {}",
                logins_text(&engine.logins()[revoked_at..])
            ))),
        },
        Err(err) => Err(err),
    };
    report.record(
        TOKEN_ROTATED,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );

    // 4. The echo tunnel's agent Pod killed: its replacement brings the tunnel back.
    let started = Instant::now();
    let outcome = kill_agent(&client, ns, &tunnels, &engine, "echo").await;
    report.record(
        AGENT_KILLED,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );

    // 5. The engine process SIGKILLed under a live stream through echo: the stream ends at the
    //    client; echo Ready=False with a reason, web TunnelReady=False and Ready=False while it is
    //    down; started again on the same address with the same certificate: the agents log in
    //    again (new control connections, the token in force), both tunnels Ready, traffic flows,
    //    a new stream through echo echoes bytes.
    let started = Instant::now();
    let live = open_stream(&tunnels, &engine, "echo", LIVE_BYTES).await;
    let addr = engine.addr();
    let (live_end, _keep_write) = match live {
        Ok(stream) => {
            let (read, write) = stream.into_split();
            (Ok(tokio::spawn(stream_end(read))), Some(write))
        }
        Err(err) => (Err(err), None),
    };
    let killed = Instant::now();
    engine.kill().await?;
    let ended = match live_end {
        Ok(task) => match tokio::time::timeout(LIVE_END_LIMIT, task).await {
            Ok(Ok((at, how))) => Ok((at - killed, how)),
            Ok(Err(err)) => Err(anyhow::anyhow!("the stream reader: {err}")),
            Err(_) => Err(anyhow::anyhow!(
                "the stream through echo was still open {LIVE_END_LIMIT:?} after the engine was killed"
            )),
        },
        Err(err) => Err(err.context("opening the live stream through echo")),
    };
    let echo_down = wait_condition(&tunnels, "echo", "Ready", "False", OUTAGE_LIMIT)
        .await
        .map(|t| (killed.elapsed(), t));
    let web_down = wait_condition(&tunnels, "web", "TunnelReady", "False", OUTAGE_LIMIT)
        .await
        .map(|t| (killed.elapsed(), t));
    let web_unready = web_down
        .as_ref()
        .ok()
        .and_then(|(_, t)| condition(t, "Ready"));
    engine =
        EngineProcess::start(&bin, addr, &identity_file, identity.ca_pem(), &[TOKEN_2]).await?;
    let restarted = Instant::now();
    let relogin = wait_logins(&engine, TOKEN_2, 2, OUTAGE_LIMIT).await;
    let back = wait_condition(&tunnels, "web", "Ready", "True", OUTAGE_LIMIT)
        .await
        .map(|_| restarted.elapsed());
    let echo_back = wait_condition(&tunnels, "echo", "Ready", "True", OUTAGE_LIMIT)
        .await
        .map(|_| restarted.elapsed());
    let sent = match (&back, &echo_back) {
        (Ok(_), Ok(_)) => traffic(&tunnels, &engine)
            .await
            .map(|sent| (restarted.elapsed(), sent)),
        _ => Err(anyhow::anyhow!("not tried: the tunnels are not Ready")),
    };
    let web_was_down = web_unready.as_ref().is_some_and(|(s, _, _)| s == "False");
    report.record(
        ENGINE_KILLED,
        web_down.is_ok() && web_was_down && relogin.is_ok() && back.is_ok() && sent.is_ok(),
        started,
        format!(
            "while down: {}; after the restart: {}; {}; {}",
            match &web_down {
                Ok((at, t)) => format!(
                    "TunnelReady {:?}, Ready {:?} (seen {at:.1?} after the kill)",
                    condition(t, "TunnelReady"),
                    condition(t, "Ready")
                ),
                Err(e) => format!("{e:#}"),
            },
            match &relogin {
                Ok((at, logins)) =>
                    format!("the agents logged in again {at:.1?} after it: {logins}"),
                Err(e) => format!("{e:#}"),
            },
            match &back {
                Ok(at) => format!("web Ready {at:.1?} after the restart"),
                Err(e) => format!("{e:#}"),
            },
            match &sent {
                Ok((at, sent)) => format!("{sent} (done {at:.1?} after the restart)"),
                Err(e) => format!("{e:#}"),
            },
        ),
    );
    let fresh = match &echo_back {
        Ok(_) => echo_through(&tunnels, &engine, "echo", LIVE_BYTES)
            .await
            .map(|(took, tries)| (restarted.elapsed(), took, tries)),
        Err(_) => Err(anyhow::anyhow!("not tried: echo is not Ready")),
    };
    // Not-Ready with a reason: the condition names why.
    let echo_reason = echo_down
        .as_ref()
        .ok()
        .and_then(|(_, t)| condition(t, "Ready"));
    let reasoned = echo_reason.as_ref().is_some_and(|(_, r, _)| !r.is_empty());
    report.record(
        &engine_killed_live(),
        ended.is_ok() && reasoned && echo_back.is_ok() && fresh.is_ok(),
        started,
        format!(
            "live stream: {}; echo while down: {}; engine back: {}; new stream: {}",
            match &ended {
                Ok((at, how)) => format!(
                    "{LIVE_BYTES} bytes echoed, then {how} {at:.2?} after the SIGKILL"
                ),
                Err(e) => format!("{e:#}"),
            },
            match &echo_down {
                Ok((at, t)) => format!(
                    "Ready {:?}, TunnelReady {:?} (seen {at:.1?} after the kill)",
                    condition(t, "Ready"),
                    condition(t, "TunnelReady")
                ),
                Err(e) => format!("{e:#}"),
            },
            match &echo_back {
                Ok(at) => format!("echo Ready {at:.1?} after the engine restarted"),
                Err(e) => format!("{e:#}"),
            },
            match &fresh {
                Ok((at, took, tries)) => format!(
                    "{LIVE_BYTES} bytes intact in {took:.2?} (try {tries}), {at:.1?} after the engine restarted"
                ),
                Err(e) => format!("{e:#}"),
            },
        ),
    );

    // 6. Deleting the tunnel removes its agent and every child (finalizer and garbage collector).
    let started = Instant::now();
    let outcome = delete_tunnel(env, &tunnels, ns, "web").await;
    report.record(
        TUNNEL_DELETED,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );
    tunnels.delete("echo", &DeleteParams::default()).await?;
    engine.shutdown().await;
    Ok(())
}

async fn delete_tunnel(
    env: &Env<'_>,
    tunnels: &Api<RstreamTunnel>,
    ns: &str,
    name: &str,
) -> anyhow::Result<String> {
    let client = env.plane.client().await?;
    let t = tunnels.get(name).await?;
    let base = names::base_name(ns, name, t.metadata.uid.as_deref());
    tunnels.delete(name, &DeleteParams::default()).await?;
    let started = Instant::now();
    loop {
        let mut left = Vec::new();
        if tunnels.get_opt(name).await?.is_some() {
            left.push(format!("RstreamTunnel {name}"));
        }
        if Api::<Deployment>::namespaced(client.clone(), ns)
            .get_opt(&base)
            .await?
            .is_some()
        {
            left.push("Deployment".to_owned());
        }
        if Api::<ServiceAccount>::namespaced(client.clone(), ns)
            .get_opt(&base)
            .await?
            .is_some()
        {
            left.push("ServiceAccount".to_owned());
        }
        if Api::<Role>::namespaced(client.clone(), ns)
            .get_opt(&base)
            .await?
            .is_some()
        {
            left.push("Role".to_owned());
        }
        if Api::<RoleBinding>::namespaced(client.clone(), ns)
            .get_opt(&base)
            .await?
            .is_some()
        {
            left.push("RoleBinding".to_owned());
        }
        if Api::<ConfigMap>::namespaced(client.clone(), ns)
            .get_opt(&format!("{base}-config"))
            .await?
            .is_some()
        {
            left.push("ConfigMap".to_owned());
        }
        let pods = Api::<Pod>::namespaced(client.clone(), ns)
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|p| {
                p.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with(&base))
            })
            .count();
        if pods > 0 {
            left.push(format!("{pods} agent Pods"));
        }
        if left.is_empty() {
            return Ok(format!("all gone after {:.1?}", started.elapsed()));
        }
        if started.elapsed() > Duration::from_secs(90) {
            bail!("after 90 s still there: {}", left.join(", "));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
