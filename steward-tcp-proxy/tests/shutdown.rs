//! steward on SIGTERM: readiness drops, the shutdown delay, and the drain of long watches.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use netkit_testenv::{ControlPlane, eventually};

mod support;

/// The drain deadline and the shutdown delay of these tests: what happens inside them takes
/// milliseconds, so 10 s leaves a busy machine room; the bounds below are lower bounds of them.
const WINDOW: Duration = Duration::from_secs(10);

type ConfigMapEvents = futures::stream::BoxStream<'static, kube::Result<WatchEvent<ConfigMap>>>;

use support::*;

/// Starts steward with `drain_flags`, opens a ConfigMap watch through it, sends SIGTERM and waits
/// for `/readyz` to say it is shutting down; returns the proxy, the namespace, the watch and
/// when the signal went.
async fn watch_then_terminate(
    plane: &'static ControlPlane,
    prefix: &str,
    drain_flags: &[&str],
) -> (Proxy, String, ConfigMapEvents, Instant) {
    let ns = plane.create_namespace(prefix).await.unwrap();
    let namespace_flag = format!("--service-namespace={ns}");
    let mut flags = vec![namespace_flag.as_str(), "--service-name=absent"];
    flags.extend_from_slice(drain_flags);
    let proxy = Proxy::start(plane.kubeconfig_path(), &apiserver_addr(plane), &flags);
    eventually("listening", Duration::from_secs(30), || async {
        tokio::net::TcpStream::connect(proxy.listen).await.is_ok()
    })
    .await;
    let through = client_through(plane, proxy.listen).await;
    let events = Api::<ConfigMap>::namespaced(through, &ns)
        .watch(&WatchParams::default().timeout(60), "0")
        .await
        .unwrap()
        .boxed();

    let signalled = Instant::now();
    proxy.terminate();
    // Within the window after the signal (the drain or the shutdown delay, 10 s in both tests).
    eventually("not ready after SIGTERM", WINDOW, || async {
        proxy
            .readyz()
            .await
            .is_some_and(|(code, body)| code == 503 && body.contains("shutting down"))
    })
    .await;
    (proxy, ns, events, signalled)
}

#[tokio::test]
async fn sigterm_drops_readiness_and_drains_a_long_watch() {
    let plane = plane().await;
    // The deadline alone: a quiet watch stays open until it.
    let (mut proxy, ns, mut events, signalled) = watch_then_terminate(
        plane,
        "steward-drain",
        &["--drain-timeout=10s", "--drain-idle=0", "--threads=1"],
    )
    .await;
    // The running watch keeps delivering during the drain window...
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some("during-drain".into());
    Api::<ConfigMap>::namespaced(plane.client().await.unwrap(), &ns)
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();
    assert_eq!(next_added(&mut events, WINDOW).await, "during-drain");
    // ...and new connections are refused.
    assert!(tokio::net::TcpStream::connect(proxy.listen).await.is_err());
    // At the deadline the watch is cut and the process exits cleanly.
    let ended = tokio::time::timeout(WINDOW + Duration::from_secs(30), async {
        while let Ok(Some(_)) = events.try_next().await {}
    })
    .await;
    assert!(
        ended.is_ok(),
        "the watch outlived the drain deadline by 30 s"
    );
    let drained = signalled.elapsed();
    eprintln!("the watch was cut {drained:?} after SIGTERM (drain deadline {WINDOW:?})");
    assert!(
        drained >= WINDOW - Duration::from_millis(500),
        "cut before the deadline: {drained:?}"
    );
    let status = tokio::task::spawn_blocking(move || {
        let status = proxy.child.wait();
        (status, proxy)
    })
    .await
    .unwrap()
    .0
    .unwrap();
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn sigterm_keeps_accepting_for_the_shutdown_delay_then_closes_quiet_connections_early() {
    let plane = plane().await;
    let (mut proxy, ns, mut events, signalled) = watch_then_terminate(
        plane,
        "steward-delay",
        &[
            "--shutdown-delay=10s",
            "--drain-timeout=5m",
            "--drain-idle=50ms",
        ],
    )
    .await;
    // During the delay a new client, as kube-proxy may still send one, is served.
    let late = client_through(plane, proxy.listen).await;
    Api::<ConfigMap>::namespaced(late, &ns)
        .list(&ListParams::default())
        .await
        .expect("a new connection during the shutdown delay is relayed");
    // After it, the quiet watch is closed at once, long before the 5 min deadline, and the
    // process exits cleanly.
    let ended = tokio::time::timeout(WINDOW + Duration::from_secs(60), async {
        while let Ok(Some(_)) = events.try_next().await {}
    })
    .await;
    let closed = signalled.elapsed();
    eprintln!("the quiet watch was closed {closed:?} after SIGTERM (shutdown delay {WINDOW:?})");
    assert!(ended.is_ok(), "the quiet watch was kept until the deadline");
    assert!(
        closed >= WINDOW - Duration::from_millis(100),
        "closed during the shutdown delay: {closed:?}"
    );
    let status = tokio::task::spawn_blocking(move || {
        let status = proxy.child.wait();
        (status, proxy)
    })
    .await
    .unwrap()
    .0
    .unwrap();
    assert!(status.success(), "{status}");
    assert!(
        signalled.elapsed() < Duration::from_secs(300),
        "the drain waited for the deadline: {:?}",
        signalled.elapsed()
    );
}
