//! rstream-operator from its chart, with the seed's Quick Start as the e2e runs it: a
//! `LocalEngine` here on the host's end of the node link (a self-hosted engine with a private CA,
//! given to the agent by Secret reference), a workload behind Service `web`, an
//! `RstreamConnection` and an HTTP `RstreamTunnel`. The manager makes the agent Deployment,
//! kubelet runs it, and a GET to the engine's ingress reaches the workload Pod.

use anyhow::ensure;
use rstream_client::engine::LocalEngine;

use super::{Shown, describe_pods};
use netkit_testenv::e2e::Env;
use netkit_testenv::e2e::rstream_operator::{self, http_tunnel_spec};
use netkit_testenv::node::check;

const TUNNEL: &str = "web";

/// Starts the engine into `engine`, so that the demo stops it however it ends.
pub async fn start(env: &Env<'_>, engine: &mut Option<LocalEngine>) -> anyhow::Result<Shown> {
    let ns = env.restricted_namespace("demo-rstream").await?;
    rstream_operator::install(env, &ns).await?;
    check::wait_pods_ready(env.plane, &ns, rstream_operator::SELECTOR, 1).await?;
    let engine = &*engine.insert(rstream_operator::start_engine(None).await?);
    let client = env.plane.client().await?;
    rstream_operator::quick_start(&client, &ns, engine, &[(TUNNEL, http_tunnel_spec())]).await?;
    let tunnel = rstream_operator::http_tunnel(env, engine, &ns, TUNNEL).await?;
    ensure!(
        tunnel.passed(),
        "the tunnel did not carry a request to the workload: {}",
        tunnel.describe()
    );
    let ingress = tunnel
        .ingress
        .map(|addr| addr.to_string())
        .unwrap_or_default();

    let mut facts = describe_pods(env, &ns, "").await?;
    facts.push(format!(
        "RstreamTunnel {ns}/{TUNNEL} Ready: tunnel {} on LocalEngine {} (in this process), agent Deployment {} Available",
        tunnel.tunnel_id,
        engine.addr(),
        tunnel.agent_deployment
    ));
    facts.push(format!(
        "forwarding address {} (LocalEngine serves it as plain HTTP); GET http://{ingress}/ (attempt {}) answered by the workload: {}",
        tunnel.forwarding_address,
        tunnel.attempts,
        tunnel.answer.as_deref().map(str::trim).unwrap_or_default()
    ));
    Ok(Shown {
        name: "rstream-operator",
        facts,
        try_these: vec![
            format!("kubectl -n {ns} get rconn,rtun"),
            format!("kubectl -n {ns} describe rtun {TUNNEL}"),
            format!(
                "curl http://{ingress}/   # the engine's ingress -> agent Pod -> Service web -> workload Pod"
            ),
        ],
    })
}
