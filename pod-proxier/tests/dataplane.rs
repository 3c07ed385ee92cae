//! The embedded data plane on its own (no API server): what V2 mappings rely on, with loopback
//! upstreams that EndpointSlices cannot carry (the API server refuses loopback addresses there).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pod_proxier::dataplane::embedded::EmbeddedPlane;
use pod_proxier::dataplane::{DesiredPorts, PortRoute};
use proxy_core::metrics::NoopObserver;
use proxy_core::server::DataPath;
use proxy_core::upstream::HealthCheck;
use support::{backend, free_port, greeting, greeting_from};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

fn route(name: &str, upstreams: Vec<SocketAddr>, checked: bool, close: bool) -> PortRoute {
    PortRoute {
        name: name.into(),
        upstreams,
        health_checked: checked,
        close_connections: close,
        allowed_sources: None,
    }
}

async fn a_service_route_balances_over_healthy_endpoints_only(data_path: DataPath) {
    let check =
        HealthCheck::new(Duration::from_millis(100), Duration::from_millis(100), 1, 1).unwrap();
    let plane = EmbeddedPlane::new(
        "127.0.0.1".parse().unwrap(),
        Arc::new(NoopObserver),
        Some(check),
        Duration::from_secs(1),
        data_path,
    )
    .unwrap();
    let e1 = backend("127.0.0.41", "e1").await;
    let e2 = backend("127.0.0.42", "e2").await;
    // A ready endpoint whose server is gone: the health check takes it out.
    let dead = SocketAddr::new("127.0.0.43".parse().unwrap(), free_port());
    let port = free_port();
    let entry = SocketAddr::from(([127, 0, 0, 1], port));
    let desired: DesiredPorts = [(
        port,
        route("svc.ns.a.debug", vec![e1, e2, dead], true, false),
    )]
    .into();
    assert!(plane.sync(&desired).await.is_empty());
    // Polled (bounded), not slept on: once the health check has taken the dead one out, a whole
    // round of connections is served, by e1 and e2 only.
    let deadline = Instant::now() + Duration::from_secs(30);
    let seen = loop {
        let mut seen = BTreeSet::new();
        let mut served = true;
        for _ in 0..12 {
            match greeting(entry).await {
                Some(g) => {
                    seen.insert(g);
                }
                None => {
                    served = false;
                    break;
                }
            }
        }
        if served {
            break seen;
        }
        assert!(
            Instant::now() < deadline,
            "connections still fail 30 s after the sync: the health check never took {dead} out"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(seen, BTreeSet::from(["e1".to_owned(), "e2".to_owned()]));
    // Failover alone also serves every connection (a refused connect moves on to the next
    // target), so the proof is the set's own view: the dead endpoint is out, the others in.
    let expected = [
        (e1.to_string(), true),
        (e2.to_string(), true),
        (dead.to_string(), false),
    ];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let health: Vec<(String, bool)> = plane
            .upstream_status(port)
            .await
            .expect("a route with three targets has an upstream set")
            .into_iter()
            .map(|t| (t.addr.to_string(), t.healthy))
            .collect();
        if health == expected {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "30 s after the sync the health check has not taken {dead} (only) out: {health:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Endpoints change: the next connection follows, an established one keeps its upstream.
    let mut held = TcpStream::connect(entry).await.unwrap();
    let mut line = [0u8; 3];
    held.read_exact(&mut line).await.unwrap();
    let e3 = backend("127.0.0.44", "e3").await;
    let desired: DesiredPorts = [(port, route("svc.ns.a.debug", vec![e3], true, false))].into();
    let started = Instant::now();
    assert!(plane.sync(&desired).await.is_empty());
    // Applied when the sync returns: the next connection goes to e3. The speed of a route
    // change is a benchmark's figure, printed.
    eprintln!("a route change took {:?}", started.elapsed());
    assert_eq!(greeting(entry).await.as_deref(), Some("e3"));
    held.write_all(b"ping").await.unwrap();
    let mut echo = [0u8; 4];
    held.read_exact(&mut echo).await.unwrap();
    assert_eq!(&echo, b"ping");

    // No endpoints: connections are refused (closed at once), the port stays allocated.
    let desired: DesiredPorts = [(port, route("svc.ns.a.debug", vec![], true, false))].into();
    plane.sync(&desired).await;
    assert_eq!(greeting(entry).await, None);
    assert!(std::net::TcpListener::bind(entry).is_err());

    // Removed from the desired state: the port is released.
    plane.sync(&DesiredPorts::new()).await;
    let released = Instant::now();
    while std::net::TcpListener::bind(entry).is_err() {
        assert!(
            released.elapsed() < Duration::from_secs(30),
            "{entry} still bound 30 s after its route was removed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    plane.shutdown(Duration::from_millis(100)).await;
}

async fn a_mapping_that_asks_for_it_cuts_established_connections(data_path: DataPath) {
    let plane = EmbeddedPlane::new(
        "127.0.0.1".parse().unwrap(),
        Arc::new(NoopObserver),
        None,
        Duration::from_secs(1),
        data_path,
    )
    .unwrap();
    let a = backend("127.0.0.45", "a").await;
    let b = backend("127.0.0.46", "b").await;
    let port = free_port();
    let entry = SocketAddr::from(([127, 0, 0, 1], port));
    plane
        .sync(&[(port, route("v1", vec![a], false, false))].into())
        .await;
    let mut held = TcpStream::connect(entry).await.unwrap();
    let mut line = [0u8; 2];
    held.read_exact(&mut line).await.unwrap();
    plane
        .sync(&[(port, route("v1", vec![b], false, true))].into())
        .await;
    assert_eq!(greeting(entry).await.as_deref(), Some("b"));
    let mut rest = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(30), held.read_to_end(&mut rest))
        .await
        .expect("the old connection stayed open for 30 s");
    assert!(
        n.is_err() || rest.is_empty(),
        "the old connection stayed open"
    );
    plane.shutdown(Duration::from_millis(100)).await;
}

async fn a_checked_entry_port_admits_its_mappings_sources_and_follows_them(data_path: DataPath) {
    use pod_proxier::metrics::EntryLabels;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;

    let (checked, open) = (free_port(), free_port());
    let refused: Family<EntryLabels, Counter> = Family::default();
    let count = |port| {
        refused
            .get_or_create(&EntryLabels { entry_port: port })
            .get()
    };
    let plane = EmbeddedPlane::new(
        "127.0.0.1".parse().unwrap(),
        Arc::new(NoopObserver),
        None,
        Duration::from_secs(1),
        data_path,
    )
    .unwrap()
    .with_source_checks([checked], refused.clone());
    let a = backend("127.0.0.47", "a").await;
    let b = backend("127.0.0.48", "b").await;
    let v1 = |target, sources: &[&str]| PortRoute {
        allowed_sources: Some(sources.iter().map(|s| s.parse().unwrap()).collect()),
        ..route("v1", vec![target], false, false)
    };
    let entry = SocketAddr::from(([127, 0, 0, 1], checked));
    let unchecked = SocketAddr::from(([127, 0, 0, 1], open));
    let desired: DesiredPorts = [
        (checked, v1(a, &["127.0.0.1"])),
        (open, v1(a, &["127.0.0.1"])),
    ]
    .into();
    assert!(plane.sync(&desired).await.is_empty());
    assert_eq!(
        greeting_from("127.0.0.1", entry).await.as_deref(),
        Some("a")
    );
    assert_eq!(greeting_from("127.0.0.2", entry).await, None);
    assert_eq!(count(checked), 1);
    // A port outside the checked ones admits everyone, as before.
    assert_eq!(
        greeting_from("127.0.0.2", unchecked).await.as_deref(),
        Some("a")
    );
    assert_eq!(count(open), 0);

    // Another mapping takes the port with other sources.
    let desired: DesiredPorts = [(checked, v1(b, &["127.0.0.2/32"]))].into();
    assert!(plane.sync(&desired).await.is_empty());
    assert_eq!(
        greeting_from("127.0.0.2", entry).await.as_deref(),
        Some("b")
    );
    assert_eq!(greeting_from("127.0.0.1", entry).await, None);
    assert_eq!(count(checked), 2);

    // Only the sources change (the route stays): followed as well.
    let desired: DesiredPorts = [(checked, v1(b, &["127.0.0.0/31"]))].into();
    assert!(plane.sync(&desired).await.is_empty());
    assert_eq!(
        greeting_from("127.0.0.1", entry).await.as_deref(),
        Some("b")
    );
    assert_eq!(greeting_from("127.0.0.2", entry).await, None);
    assert_eq!(count(checked), 3);
    plane.shutdown(Duration::from_millis(100)).await;
}

/// Names the threads connections were opened on: the observer is called where a connection is
/// relayed.
#[derive(Default)]
struct ThreadsObserver {
    opened_on: std::sync::Mutex<Vec<String>>,
}

impl proxy_core::metrics::RelayObserver for ThreadsObserver {
    fn connection_opened(&self, _: &proxy_core::metrics::RouteLabels) {
        let thread = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_owned();
        self.opened_on.lock().unwrap().push(thread);
    }
}

/// `--data-path` reaches the server: a mapping to one address is relayed on proxy-core's
/// event-loop thread with `event-loop`, and on the test's runtime with `tokio`.
#[tokio::test]
async fn the_data_path_setting_chooses_what_relays_a_mapping() {
    let upstream = backend("127.0.0.47", "up").await;
    for (data_path, loop_thread) in [(DataPath::EventLoop, true), (DataPath::Tokio, false)] {
        let observer = Arc::new(ThreadsObserver::default());
        let plane = EmbeddedPlane::new(
            "127.0.0.1".parse().unwrap(),
            observer.clone(),
            None,
            Duration::from_secs(1),
            data_path,
        )
        .unwrap();
        let port = free_port();
        plane
            .sync(&[(port, route("v1", vec![upstream], false, false))].into())
            .await;
        let entry = SocketAddr::from(([127, 0, 0, 1], port));
        assert_eq!(greeting(entry).await.as_deref(), Some("up"));
        plane.shutdown(Duration::from_millis(100)).await;
        let threads = observer.opened_on.lock().unwrap().clone();
        assert_eq!(threads.len(), 1, "{data_path}: {threads:?}");
        assert_eq!(
            threads[0].starts_with("proxy-worker-"),
            loop_thread,
            "{data_path}: opened on {threads:?}"
        );
    }
}

// Each scenario on both data paths: the event loop (the default on Linux) and tokio tasks.

#[tokio::test]
async fn a_service_route_balances_over_healthy_endpoints_only_on_event_loop() {
    a_service_route_balances_over_healthy_endpoints_only(DataPath::EventLoop).await;
}

#[tokio::test]
async fn a_service_route_balances_over_healthy_endpoints_only_on_tokio() {
    a_service_route_balances_over_healthy_endpoints_only(DataPath::Tokio).await;
}

#[tokio::test]
async fn a_mapping_that_asks_for_it_cuts_established_connections_on_event_loop() {
    a_mapping_that_asks_for_it_cuts_established_connections(DataPath::EventLoop).await;
}

#[tokio::test]
async fn a_mapping_that_asks_for_it_cuts_established_connections_on_tokio() {
    a_mapping_that_asks_for_it_cuts_established_connections(DataPath::Tokio).await;
}

#[tokio::test]
async fn a_checked_entry_port_admits_its_mappings_sources_and_follows_them_on_event_loop() {
    a_checked_entry_port_admits_its_mappings_sources_and_follows_them(DataPath::EventLoop).await;
}

#[tokio::test]
async fn a_checked_entry_port_admits_its_mappings_sources_and_follows_them_on_tokio() {
    a_checked_entry_port_admits_its_mappings_sources_and_follows_them(DataPath::Tokio).await;
}
