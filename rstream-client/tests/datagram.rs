//! Datagram tunnels over TLS against LocalEngine: the UDP ingress, the client's UDP relay and a UDP
//! echo on loopback; private datagram dials with records at the limit.
#![cfg(feature = "engine")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use common::*;
use netkit_testenv::fixtures::{
    MAX_UDP_PAYLOAD, tagged_datagram, tagged_datagram_len, udp_echo_server,
};
use rstream_client::Error;
use rstream_client::datagram::{DatagramError, DatagramStream, MAX_DATAGRAM_LEN};
use rstream_client::forward;
use rstream_client::tunnel::{HttpVersion, TunnelOptions, TunnelProtocol, TunnelType};
use tokio::net::UdpSocket;

#[tokio::test]
async fn ten_thousand_datagrams_through_the_udp_ingress_come_back_intact_and_in_order() {
    let engine = engine().await;
    let echo = udp_echo_server().await.unwrap();
    let control = client(&engine).connect().await.unwrap();
    let mut tunnel = control
        .create_tunnel(TunnelOptions::dtls().datagram_guaranteed_delivery(true))
        .await
        .unwrap();
    let props = tunnel.properties().clone();
    assert_eq!(props.r#type.as_deref(), Some("datagram"));
    assert_eq!(props.protocol.as_deref(), Some("dtls"));
    assert_eq!(
        engine.tunnel_requests()[0].datagram_guaranteed_delivery,
        Some(true)
    );
    let ingress = engine.udp_ingress_addr(tunnel.id()).unwrap();
    assert_eq!(engine.ingress_addr(tunnel.id()), None);
    assert_eq!(
        tunnel.forwarding_address().unwrap(),
        format!("127.0.0.1:{} (dtls)", ingress.port())
    );
    let forwarder = tokio::spawn(async move {
        forward::forward_to(&mut tunnel, &echo.to_string(), forward::TargetKind::Udp)
            .await
            .unwrap()
    });

    let peer = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    peer.connect(ingress).await.unwrap();
    // Flow control over loopback: at most this many bytes in flight, so no socket buffer overflows.
    const WINDOW_BYTES: usize = 96 * 1024;
    const WINDOW_COUNT: usize = 32;
    const COUNT: usize = 10_000;
    let started = Instant::now();
    let mut in_flight: VecDeque<(usize, Vec<u8>)> = VecDeque::new();
    let mut in_flight_bytes = 0;
    let mut buf = vec![0u8; 65_536];
    let (mut received, mut total_bytes, mut largest) = (0usize, 0usize, 0usize);
    let mut next = 0;
    while received < COUNT {
        let can_send = next < COUNT
            && (in_flight.is_empty()
                || (in_flight_bytes + tagged_datagram_len(next) <= WINDOW_BYTES
                    && in_flight.len() < WINDOW_COUNT));
        if can_send {
            let d = tagged_datagram(next);
            assert_eq!(peer.send(&d).await.unwrap(), d.len());
            in_flight_bytes += d.len();
            in_flight.push_back((next, d));
            next += 1;
            continue;
        }
        let n = tokio::time::timeout(Duration::from_secs(30), peer.recv(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("datagram {received} did not come back"))
            .unwrap();
        let (i, expected) = in_flight.pop_front().unwrap();
        assert!(
            buf[..n] == expected[..],
            "datagram {i} ({} bytes) came back as {n} different bytes",
            expected.len()
        );
        in_flight_bytes -= expected.len();
        total_bytes += n;
        largest = largest.max(n);
        received += 1;
    }
    let elapsed = started.elapsed();
    assert_eq!(largest, MAX_UDP_PAYLOAD);
    eprintln!(
        "{COUNT} datagrams ({total_bytes} bytes, largest {largest}) echoed in order in {elapsed:?}"
    );
    // One UDP peer, one inbound stream.
    assert_eq!(engine.proxy_conn_rsps().len(), 1);

    // A second peer gets its own stream; answers go to the right peer.
    let other = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    other.connect(ingress).await.unwrap();
    other.send(b"from the other peer").await.unwrap();
    peer.send(b"from the first peer").await.unwrap();
    for (socket, text) in [
        (&other, &b"from the other peer"[..]),
        (&peer, b"from the first peer"),
    ] {
        let n = tokio::time::timeout(Duration::from_secs(30), socket.recv(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf[..n], text);
    }
    assert!(eventually(3, || engine.proxy_conn_rsps().len() == 2).await);

    control.close().await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), forwarder)
        .await
        .unwrap()
        .unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn private_datagram_dials_carry_records_up_to_the_limit() {
    let engine = engine().await;
    let owner = client(&engine).connect().await.unwrap();
    let mut tunnel = owner
        .create_tunnel(TunnelOptions::private("udp-private").tunnel_type(TunnelType::Datagram))
        .await
        .unwrap();
    assert_eq!(engine.udp_ingress_addr(tunnel.id()), None);
    let mut near = DatagramStream::new(client(&engine).dial("udp-private").await.unwrap());
    let mut far = DatagramStream::new(tunnel.accept().await.unwrap());
    let sizes = [0, 1, 65_534, MAX_DATAGRAM_LEN, 0, 700];
    for (i, &n) in sizes.iter().enumerate() {
        let d: Vec<u8> = (0..n).map(|j| (i * 13 + j) as u8).collect();
        near.send(&d).await.unwrap();
        assert_eq!(far.recv().await.unwrap().unwrap(), d, "record {i}");
        far.send(&d).await.unwrap();
        assert_eq!(near.recv().await.unwrap().unwrap(), d, "echo {i}");
    }
    // 65 536 bytes are refused locally and nothing reaches the peer.
    let err = near.send(&vec![1; MAX_DATAGRAM_LEN + 1]).await.unwrap_err();
    assert!(matches!(err, DatagramError::TooLarge { len: 65_536 }));
    near.send(b"still fine").await.unwrap();
    assert_eq!(far.recv().await.unwrap().unwrap(), &b"still fine"[..]);
    near.close().await.unwrap();
    assert_eq!(far.recv().await.unwrap(), None);
    owner.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn quic_tunnels_and_http3_stay_refused_before_anything_is_sent() {
    let engine = engine().await;
    let control = client(&engine).connect().await.unwrap();
    for options in [
        TunnelOptions::new().protocol(TunnelProtocol::Quic),
        TunnelOptions::http().http_version(HttpVersion::H3),
    ] {
        match control.create_tunnel(options).await {
            Err(Error::Unsupported(m)) => assert!(m.contains("QUIC"), "{m}"),
            other => panic!("expected unsupported, got {other:?}"),
        }
    }
    assert!(engine.tunnel_requests().is_empty());
    control.close().await.unwrap();
    engine.shutdown().await;
}
