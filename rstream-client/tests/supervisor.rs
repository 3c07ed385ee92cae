//! The supervisor against a LocalEngine that restarts, goes silent, or refuses credentials.
#![cfg(feature = "engine")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use rstream_client::engine::LocalEngine;
use rstream_client::supervisor::{
    StableHostname, Supervisor, SupervisorConfig, SupervisorHandle, SupervisorState,
};
use rstream_client::tunnel::TunnelOptions;
use rstream_client::{EngineErrorCode, Error, forward};

fn fast() -> SupervisorConfig {
    SupervisorConfig::default().backoff(Duration::from_millis(100), Duration::from_millis(400))
}

async fn next(handle: &mut SupervisorHandle) -> SupervisorState {
    within(15, handle.next_event())
        .await
        .expect("supervisor ended")
}

async fn wait_online(handle: &mut SupervisorHandle) -> (String, String) {
    loop {
        match next(handle).await {
            SupervisorState::Online {
                properties,
                forwarding_address,
            } => {
                return (properties.id.unwrap(), forwarding_address);
            }
            SupervisorState::Stopped { error } => panic!("stopped: {error:?}"),
            _ => {}
        }
    }
}

async fn wait_disconnected(handle: &mut SupervisorHandle) -> Error {
    loop {
        match next(handle).await {
            SupervisorState::Disconnected { error, retry_in } => {
                assert!(retry_in <= Duration::from_millis(400));
                return error;
            }
            SupervisorState::Stopped { error } => panic!("stopped: {error:?}"),
            _ => {}
        }
    }
}

#[tokio::test]
async fn engine_restart_reconnects_and_recreates_the_tunnel_with_the_same_hostname() {
    let engine = engine().await;
    let addr = engine.addr();
    let identity = engine.identity().clone();
    let stable = "r0badc0de-app.t.example.io";
    let config = fast().stable_hostname(StableHostname::Fixed(stable.into()));
    let mut handle = Supervisor::spawn(client(&engine), TunnelOptions::http().name("web"), config);
    assert!(matches!(
        next(&mut handle).await,
        SupervisorState::Connecting { attempt: 1 }
    ));
    let (first_id, address) = wait_online(&mut handle).await;
    let port = engine.ingress_addr(&first_id).unwrap().port();
    assert_eq!(address, format!("https://{stable}:{port}"));

    // Relay through the supervised tunnel.
    let target = echo_server().await;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (handle_tx, handle_rx) = tokio::sync::oneshot::channel();
    let fwd = tokio::spawn(async move {
        let target = target.to_string();
        tokio::select! {
            _ = forward::forward(&mut handle, &target) => {}
            _ = stop_rx => {}
        }
        let _ = handle_tx.send(handle);
    });
    assert_eq!(
        within(
            10,
            roundtrip(engine.ingress_addr(&first_id).unwrap(), b"before")
        )
        .await,
        b"before"
    );

    // The engine goes away, then comes back on the same port with the same certificate.
    engine.shutdown().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let engine = LocalEngine::builder()
        .bind(addr)
        .identity(identity)
        .token(TOKEN)
        .start()
        .await
        .unwrap();
    assert!(
        eventually(10, || !engine.tunnels().is_empty()).await,
        "the tunnel is re-created"
    );
    let second = engine.tunnels()[0].clone();
    assert_eq!(
        second.hostname.as_deref(),
        Some(stable),
        "the stable hostname is reused"
    );
    let ingress = engine.ingress_addr(second.id.as_deref().unwrap()).unwrap();
    assert_eq!(within(10, roundtrip(ingress, b"after")).await, b"after");

    stop_tx.send(()).unwrap();
    fwd.await.unwrap();
    let mut handle = handle_rx.await.unwrap();
    // The event log shows the disconnection with its (retryable) error and the recovery.
    let error = wait_disconnected(&mut handle).await;
    assert!(error.retryable(), "{error}");
    let (second_id, _) = wait_online(&mut handle).await;
    assert_eq!(Some(second_id.as_str()), second.id.as_deref());
    handle.shutdown().await;
    assert!(
        eventually(5, || engine.control_channels() == 0).await,
        "shutdown closes the control channel"
    );
    engine.shutdown().await;
}

#[tokio::test]
async fn liveness_loss_is_reported_and_recovered() {
    let engine = LocalEngine::builder()
        .token(TOKEN)
        .liveness_timeout(Duration::from_millis(1200))
        .start()
        .await
        .unwrap();
    let client = builder(&engine)
        .heartbeat_interval(Some(Duration::from_secs(1)))
        .build()
        .unwrap();
    let mut handle = Supervisor::spawn(client, TunnelOptions::tcp(), fast());
    wait_online(&mut handle).await;
    engine
        .faults()
        .stop_acking_heartbeats
        .store(true, Ordering::SeqCst);
    let error = wait_disconnected(&mut handle).await;
    assert!(matches!(error, Error::ControlLiveness(_)), "{error}");
    engine
        .faults()
        .stop_acking_heartbeats
        .store(false, Ordering::SeqCst);
    wait_online(&mut handle).await;
    assert!(matches!(handle.state(), SupervisorState::Online { .. }));
    // No stable hostname for TCP tunnels nor for IP-literal engines.
    assert!(
        engine
            .tunnel_requests()
            .iter()
            .all(|p| p.hostname.is_none())
    );
    handle.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn non_retryable_errors_stop_the_supervisor() {
    let engine = engine().await;
    let client = builder(&engine).token("wrong").build().unwrap();
    let mut handle = Supervisor::spawn(client, TunnelOptions::tcp(), fast());
    loop {
        match next(&mut handle).await {
            SupervisorState::Stopped { error: Some(e) } => {
                assert_eq!(e.engine_code(), Some(EngineErrorCode::Unauthorized));
                break;
            }
            SupervisorState::Online { .. } => panic!("must not come online"),
            _ => {}
        }
    }
    assert!(
        within(5, handle.accept()).await.is_none(),
        "no streams after stopping"
    );
    engine.shutdown().await;
}

#[tokio::test]
async fn unreachable_engine_backs_off_until_it_appears() {
    // Reserve a port, release it, and start the engine there only later.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let identity = rstream_client::engine::EngineIdentity::generate().unwrap();
    let client = rstream_client::Client::builder()
        .engine(addr.to_string())
        .token(TOKEN)
        .tls(identity.client_tls())
        .build()
        .unwrap();
    let mut handle = Supervisor::spawn(client, TunnelOptions::tcp(), fast());
    let error = wait_disconnected(&mut handle).await;
    assert!(matches!(error, Error::Connect { .. }), "{error}");
    assert!(matches!(
        next(&mut handle).await,
        SupervisorState::Connecting { attempt: 2 }
    ));
    let engine = LocalEngine::builder()
        .bind(addr)
        .identity(identity)
        .token(TOKEN)
        .start()
        .await
        .unwrap();
    wait_online(&mut handle).await;
    handle.shutdown().await;
    engine.shutdown().await;
}
